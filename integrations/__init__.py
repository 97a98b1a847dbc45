"""Framework adapters, installed as ``guardfl.integrations`` (plain PyTorch loops, Flower).

Each adapter translates a framework's way of training into calls of ``guardfl.wrap``; no defense logic
lives here. The adapters themselves arrive with the integrations issue.
"""
