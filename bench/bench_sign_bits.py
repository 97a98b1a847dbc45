"""Can a malicious server read a face through sign compression? The feasibility measurement (2026-11-29)
that led to the red team's ``sign_bits`` (docs/research/malicious-server.md section 23, "Sign compression").

    python bench/bench_sign_bits.py [--rounds 1 4 16] [--bases dct:64 dct:150 pixel] [--eps 0.02] [--seed 1]

Sign compression keeps which entries are exactly zero: a first-layer unit that no sample fires sends a zero
bias gradient, one that some sample fires a nonzero sign. So a server learns, per unit and round, one bit:
whether any sample of the batch crosses the unit's threshold. On FC-2 (64 LFW faces, FedSGD, the client's
real path through ``ClientQuery``, no inspection):

1. ``h(w)``, the batch's top projection along a random direction ``w``: 256 units along ``w`` at 256
   thresholds, the highest that fired brackets it, three rounds refine it (to 1e-7 of the range);
2. one bit of the top sample ``x*`` per unit: unit ``k`` is ``w + eps * u_k`` with threshold
   ``h + eps * u_k . c`` (``u_k`` random, orthogonal to ``w``, in a basis: a low-frequency DCT of ``m``
   functions or the pixels; ``c`` the auxiliary faces' mean), so it fires for ``x*`` exactly when
   ``u_k . (x* - c) > 0``, and for no other sample while ``eps`` is small beside the gap to the next one;
3. ``x* - c`` estimated as the sum of ``sign * u_k`` over the rounds (one-bit compressed sensing's
   back-projection), scaled to the auxiliary faces' norm in the basis.

Printed per basis and rounds of bits: the SSIM of the read to the top sample and the best over the batch,
and whether the client's inspection (``inspect_model`` with its own batch) passes the two kinds of
model (the threshold search's rows are one direction repeated: the parallel-rows check's fingerprint).
"""

from __future__ import annotations

import argparse

import torch

from guardfl.inspect import inspect_model
from guardfl.redteam.attacks.malicious.sign_bits import back_projection, dct_basis
from guardfl.redteam.client.simulate import ClientQuery, FedSGD
from guardfl.redteam.modality.image.data import load
from guardfl.redteam.modality.image.metrics import ssim_matrix
from guardfl.redteam.modality.image.models import FC2

SHAPE, D, UNITS = (1, 25, 25), 625, 256


class Server:
    """The server's side: models of its making sent to ``client``, one bit per unit read back."""

    def __init__(self, client: ClientQuery, gen: torch.Generator, honest: torch.nn.Module):
        self.client, self.gen, self.honest = client, gen, honest
        self.sent = []

    def model(self, rows: torch.Tensor, biases: torch.Tensor) -> torch.nn.Module:
        m = FC2(SHAPE)
        with torch.no_grad():
            m.load_state_dict(self.honest.state_dict())
            m.net[1].weight.copy_(rows.float())
            m.net[1].bias.copy_(biases.float())
        return m

    def fired(self, rows: torch.Tensor, biases: torch.Tensor) -> torch.Tensor:
        m = self.model(rows, biases)
        self.sent.append(m)
        return self.client(m).update["net.1.bias"].double() != 0

    def top_projection(self, w: torch.Tensor, lo: float, hi: float, rounds: int = 3) -> float | None:
        for _ in range(rounds):
            t = torch.linspace(lo, hi, UNITS, dtype=torch.float64)
            fired = self.fired(w.expand(UNITS, D), -t)
            if not fired.any():
                return None
            k = int(torch.nonzero(fired).max())
            lo, hi = float(t[k]), float(t[k]) + (hi - lo) / (UNITS - 1)
        return lo

    def bits(self, w: torch.Tensor, h: float, c: torch.Tensor, eps: float, rounds: int, basis: torch.Tensor) -> torch.Tensor:
        est = torch.zeros(D, dtype=torch.float64)
        for _ in range(rounds):
            u = torch.randn(UNITS, basis.shape[1], generator=self.gen, dtype=torch.float64) @ basis.T
            u = u - (u @ w)[:, None] * w[None, :]
            est += back_projection(u, self.fired(w[None, :] + eps * u, -(h + eps * (u @ c)) + 1e-9))
        return est


def verdict(inspection) -> str:
    """``pass``, or ``refused`` and the checks that refused (the names before each reason's colon)."""
    return "pass" if inspection.ok else "refused (" + ", ".join(sorted({r.split(":")[0] for r in inspection.reasons})) + ")"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", nargs="+", type=int, default=[1, 4, 16])
    ap.add_argument("--bases", nargs="+", default=["dct:64", "dct:150", "pixel"])
    ap.add_argument("--eps", type=float, default=0.02)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    torch.manual_seed(0)
    x, y = load("lfw-faces")
    private, labels, aux = x[:64], y[:64], x[64:]
    honest = FC2(SHAPE)
    gen = torch.Generator().manual_seed(args.seed)
    c = aux.flatten(1).double().mean(0)
    print(f"{'basis':<8} {'rounds':>6} {'to top':>7} {'best':>6} {'top?':>5}  inspection (search model / bit model)")
    for spec in args.bases:
        basis = dct_basis(SHAPE, 0 if spec == "pixel" else int(spec.split(":")[1]))
        for rounds in args.rounds:
            server = Server(ClientQuery(private, labels, {"kind": "sign"}, FedSGD()), gen, honest)
            w = torch.randn(D, generator=gen, dtype=torch.float64)
            w /= w.norm()
            p_aux = aux.flatten(1).double() @ w
            h = server.top_projection(w, float(p_aux.min()) - 1, float(p_aux.max()) + 1)
            est = server.bits(w, h, c, args.eps, rounds, basis)
            norm = float(((aux.flatten(1).double() - c) @ basis).norm(dim=1).mean())
            coef = est @ basis
            read = (c + basis @ (coef / coef.norm() * norm)).clamp(0, 1).view(1, *SHAPE).float()
            ssim = ssim_matrix(read, private, 1.0)[:, 0]
            top = int((private.flatten(1).double() @ w).argmax())
            verdicts = [verdict(inspect_model(m, honest, batch=(private, labels))) for m in (server.sent[0], server.sent[-1])]
            print(f"{spec:<8} {rounds:>6} {ssim[top]:>7.3f} {ssim.max():>6.3f} {str(int(ssim.argmax()) == top):>5}  "
                  f"{' / '.join(verdicts)}", flush=True)


if __name__ == "__main__":
    main()
