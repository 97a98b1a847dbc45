"""Certification settings shared by the red-team tests."""

#: a claim two attacked updates can decide either way (at 50% confidence: two clean updates certify it, the
#: capital against "rate >= 0.5" reaching 2.8; two that leak refute it, 2.3): for tests of the certification
#: machinery, which attack one or two updates, not of the claim itself. One update decides nothing.
LOOSE_CLAIM = {"max_leak_rate": 0.5, "confidence": 0.5}


def leaked(cert) -> int:
    """How many private samples of a certificate (a ``Certificate`` or its JSON) leaked. Tests of one attacked
    update assert this, not the verdict: one update decides no claim (the unit is the update), and before the
    sequential rule their verdicts read exactly "some sample leaked" / "none did"."""
    evidence = cert["evidence"] if isinstance(cert, dict) else cert.evidence
    return evidence["leak_rate"]["leaked"]
