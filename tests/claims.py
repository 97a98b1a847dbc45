"""Certification settings shared by the red-team tests."""

#: a population claim one attacked sample can support (with none leaked, the 50% upper bound is 0.5 < 0.6):
#: for tests of the certification machinery, which attack one or two samples, not of the claim itself
LOOSE_CLAIM = {"max_leak_rate": 0.6, "confidence": 0.5}
