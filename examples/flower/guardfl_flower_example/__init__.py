"""A Flower app whose clients train a small CNN with guardfl defenses (see ../README.md)."""
