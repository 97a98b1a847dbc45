"""Certification: the run's recipe, its plan, its batches, the judge and the certificate."""
