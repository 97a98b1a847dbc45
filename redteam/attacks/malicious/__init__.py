"""Malicious-server attacks: Robbing the Fed, Fishing, trap weights, threshold bins, SEER."""
