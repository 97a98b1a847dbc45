"""Reports a person reads: the certificate's page, its text section, the sweep's page."""
