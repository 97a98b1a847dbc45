"""Reports a person reads: the certificate's page, its image and text sections, the sweep's page."""
