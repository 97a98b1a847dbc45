"""SignCompression's own cost: a guarded step against a plain optimizer step on ResNet-18, in one run.

    python bench/bench_sign_step.py [--steps 40] [--threads 2] [--json out.json]

Plain SGD-momentum steps and sign-guarded steps (``guardfl.wrap(SGD, SignCompression())``) are timed in
adjacent pairs (the order alternates), on the same weights (restored before every step) and the same
batch; the ratio reported is the median of the per-pair ratios, so load from other processes on the
machine cancels out approximately (it slows both steps of a pair alike). An identity-guarded step is
timed in the same pairs as a second baseline (what the wrapper costs before any defense runs).

Then the parts of a sign step on the same gradients, each the median of ``--steps`` calls: the input
finite check, the sign and its count, the statistics, the check before the inner step, and the whole
``defend_gradients``. Target (issue 33, 66): sign step <= 1.05x the plain step on CPU.

The script only needs ``guardfl.wrap`` and ``SignCompression``: run it with ``PYTHONPATH`` pointing at an
older checkout to measure that version in the same way.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F
import torchvision

from guardfl import wrap
from guardfl.defenses import Identity, SignCompression


def _median_call(fn, repeats: int, setup=None) -> float:
    times = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40, help="timed pairs")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    x, y = torch.randn(args.batch, 3, 32, 32), torch.randint(0, 10, (args.batch,))
    plain = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    signed = wrap(torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9), SignCompression(), model=model)
    ident = wrap(torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9), Identity(), model=model)
    params = list(model.parameters())
    snapshot = [p.detach().clone() for p in params]

    def restore():
        with torch.no_grad():
            torch._foreach_copy_(params, snapshot)

    def step(opt):
        restore()
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        t0 = time.perf_counter()
        opt.step()
        return time.perf_counter() - t0

    fb = {}

    def whole(opt):
        restore()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        fb.setdefault(id(opt), []).append((t1 - t0, t2 - t1))
        return t2 - t0

    for opt in (plain, signed, ident):
        whole(opt)
        whole(opt)
    ratios, ident_ratios, opt_only, times = [], [], [], {"plain": [], "sign": [], "identity": []}
    for rep in range(args.steps):
        order = [("plain", plain), ("sign", signed), ("identity", ident)]
        if rep % 2:
            order.reverse()
        t = {k: whole(o) for k, o in order}
        for k in t:
            times[k].append(t[k])
        ratios.append(t["sign"] / t["plain"])
        ident_ratios.append(t["identity"] / t["plain"])
        o = [("plain", plain), ("sign", signed)]
        if rep % 2:
            o.reverse()
        s = {k: step(opt) for k, opt in o}
        opt_only.append((s["plain"], s["sign"]))

    # the parts of a sign step, on one set of gradients
    restore()
    plain.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    grads0 = [p.grad.detach().clone() for p in params]

    def reset():
        for p, g in zip(params, grads0):
            p.grad.copy_(g)

    parts = {"defend_gradients (sign, all of it)": _median_call(signed.defend_gradients, args.steps, reset),
             "defend_gradients (identity)": _median_call(ident.defend_gradients, args.steps, reset),
             "one elementwise pass (floor)": _median_call(lambda: torch._foreach_mul_([p.grad for p in params], 1.0),
                                                          args.steps, reset),
             "inner SGD-momentum step": _median_call(plain.step, args.steps, reset)}
    try:  # the pieces as this checkout names them (absent in older versions)
        from guardfl.ops.change import signs_counting_, to_ints
        from guardfl.ops.finite import nonfinite_counts

        d = signed.defense
        parts["input finite check (nonfinite_counts)"] = _median_call(lambda: nonfinite_counts([p.grad for p in params]),
                                                                      args.steps, reset)
        parts["sign and count (signs_counting_ + to_ints)"] = _median_call(
            lambda: to_ints(signs_counting_([p.grad for p in params], d.scratch)), args.steps, reset)
    except ImportError:
        pass

    ratio = statistics.median(ratios)
    opt_ratio = statistics.median(s / p for p, s in opt_only)
    ms = lambda s: f"{1e3 * s:8.2f} ms"  # noqa: E731
    print(f"ResNet-18 (torchvision, {sum(p.numel() for p in params) / 1e6:.2f}M params), batch {args.batch}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}, {args.steps} pairs")
    print(f"plain step (forward + backward + SGD)   {ms(statistics.median(times['plain']))}")
    print(f"sign-guarded step                       {ms(statistics.median(times['sign']))}")
    print(f"identity-guarded step                   {ms(statistics.median(times['identity']))}")
    print(f"sign / plain, median of pair ratios     {ratio:8.3f}   (target <= 1.05)")
    print(f"identity / plain, median of pair ratios {statistics.median(ident_ratios):8.3f}")
    print(f"optimizer.step() alone, sign / plain    {opt_ratio:8.3f}")
    for k, o in (("plain", plain), ("sign", signed), ("identity", ident)):
        f_b = statistics.median(a for a, _ in fb[id(o)])
        st = statistics.median(b for _, b in fb[id(o)])
        print(f"  {k:9s} forward+backward {ms(f_b)}   step {ms(st)}")
    for k, v in parts.items():
        print(f"  {k:45s} {ms(v)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ratio": ratio, "identity_ratio": statistics.median(ident_ratios), "opt_step_ratio": opt_ratio,
                       "times_s": {k: statistics.median(v) for k, v in times.items()}, "parts_s": parts}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
