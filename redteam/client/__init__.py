"""The client side as the red team runs it: protocols, simulation, the user's targets, capture, the transmit simulator, DP accounting."""
