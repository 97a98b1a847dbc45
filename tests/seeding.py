"""One fixed draw of a randomised defense for a test. A deployed defense draws from OS entropy, so a
certificate near its limit is a draw (docs/research/malicious-server.md section 24); a test of the pipeline seeds it."""


def seeded(defense: dict | None, seed: int = 0) -> dict | None:
    """``defense`` (a config dict; None: none) with ``seed`` set, on each member of a stack."""
    if not defense:
        return defense
    if defense.get("kind") == "stack":
        return {**defense, "defenses": [{**d, "seed": seed} for d in defense["defenses"]]}
    return {**defense, "seed": seed}
