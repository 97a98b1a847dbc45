"""Inverting Gradients side by side: guardfl's red team against breaching 0.1.2 (Geiping et al.'s library).

    pip install --no-deps "breaching==0.1.2" "hydra-core==1.3.2" "omegaconf==2.3.0" "antlr4-python3-runtime==4.9.3"
    python bench/bench_vs_breaching.py [--models lenet,resnet18] [--iterations N] [--restarts 4] [--device auto]

(the optional extra ``vs-breaching`` names the same packages; install it with ``--no-deps`` as above, so that
pip leaves the installed torch and torchvision alone; breaching's other requirements, scipy and lpips, are
guardfl dependencies already. Not a test or CI dependency.)

What is compared. One private CIFAR-10 image (``../shared/data/cifar10-train-5k.npz``, ``--image``), one
client: Zhu et al.'s LeNet in the wide U(-0.5, 0.5) init (``LeNetZhu`` + ``wide_init_``) and ResNet-18 with
the CIFAR stem (``resnet18_cifar``, PyTorch's default init, train mode: BatchNorm on batch statistics),
FedSGD, no defense. The client's gradient is computed ONCE by ``guardfl.redteam.simulate_client`` and both
libraries attack that same gradient of the same weights, with the labels granted, from the same random
starting images, on the same device and thread count:

- guardfl: ``attacks.get("inverting_gradients", ...).reconstruct(observation, ThreatModel(labels="known"))``,
  exactly as a user calls it (restarts batched with ``torch.func.vmap``).
- breaching: its own attacker, built the way its README does for a user's own model,
  ``breaching.attacks.prepare_attack(model, CrossEntropyLoss(), cfg)`` with
  ``cfg = breaching.get_attack_config("invertinggradients", overrides)``, and
  ``attacker.reconstruct(server_payload, shared_data, {})``. breaching's case/data/server/user objects are not
  used (they download datasets and build their own models): the server payload (the model's parameters, no
  buffers, the data's metadata) and the user's shared data (the gradient list in ``model.parameters()``
  order, no buffers, the labels, one data point, no local hyperparameters = FedSGD) are built from the one
  observation, in the formats breaching's honest server and user produce.

Matched settings (breaching's ``invertinggradients`` config is the starting point; where its value and
guardfl's default differ, the value below is set on both sides):

- objective: cosine distance ``1 - <g, g*> / (|g| |g*|)`` over all parameters, scale 1 (both defaults);
- total variation: anisotropic, L1 (breaching ``inner_exp = outer_exp = 1``), weight ``--tv`` set on both
  (default 1e-2, guardfl's value; breaching's is 0.2: at 0.2 breaching's border term below costs it quality,
  e.g. final SSIM 0.45 vs guardfl's 0.52 on LeNet at 200 iterations x 2 restarts, while at 1e-2 the two stay close; with
  ``--tv 0`` the two trajectories agree sample for sample on LeNet);
- Adam, lr ``--lr`` 0.1 (both defaults), betas (0.9, 0.999), eps 1e-8 (torch defaults; guardfl's own Adam uses
  the same update), on the hard sign of the input gradient (breaching ``signed: hard``; guardfl always);
- step decay x0.1 at 3/8, 5/8 and 7/8 of the iterations (breaching ``step-lr``; guardfl's schedule);
- box constraint: projection onto [0, 1] after every step (breaching ``boxed: True`` with mean 0, std 1 in
  the metadata, so its "normalised" space IS pixel space, as the models take [0, 1] inputs unnormalised);
- iterations (``--iterations``) and restarts (``--restarts``; breaching ``restarts.num_trials``);
- starting images: guardfl's uniform [0, 1] draw from ``--seed`` (``random_inputs``); breaching's
  ``_initialize_data`` is replaced on the attacker instance to hand restart r the same image guardfl's
  restart r starts from (breaching's ``initial_data`` argument gives every restart the same image);
- labels: granted to both (breaching ``metadata.labels``; guardfl ``ThreatModel(labels="known")``);
- model mode: train mode with batch statistics on both (breaching: no buffers sent -> train mode,
  ``track_running_stats = False``; guardfl: ``bn="none"`` -> batch statistics, no BN prior);
- loss: mean cross-entropy; dtype float32, no mixed precision, no JIT (breaching ``impl`` defaults);
  no augmentations, no gradient normalisation, no Langevin noise, no gradient clipping (breaching defaults).

Not matched (each library keeps its own behaviour; none changes the work per iteration materially):

- TV at the border: breaching's TV is a padded convolution (it also counts the differences against the zero
  padding on the right and bottom edges, and adds eps 1e-8 inside |.|); guardfl averages the differences
  inside the image only. Same weight, same interior term.
- first decay step: breaching's milestones are ``N // 2.667, N // 1.6, N // 1.142`` (e.g. 374, 625, 875 for
  N = 1000), guardfl's ``floor(3N/8), floor(5N/8), floor(7N/8)`` (375, 625, 875): off by at most a few
  iterations.
- what a restart returns: breaching keeps, per restart, the iterate with the lowest objective seen (checked
  every iteration, with a host sync, ``.item()``, each iteration); guardfl returns the last iterate.
- which restart wins: breaching scores restarts by the cosine distance alone; guardfl by the full objective
  (cosine + TV).
- restarts: breaching runs them one after another; guardfl runs them batched (that is the point).
- float32 accuracy of the cosine: breaching adds each layer's float32 sums into float32 totals; guardfl adds
  each layer's float32 sums in float64 (``objectives.dot_and_square``). (Earlier guardfl reduced the flat
  update at once in float32: on ResNet-18 its norm was 0.1% off and the cosine at the true image 1.002.)
- how the cosine is computed: on ResNet-18 guardfl never builds the weight gradients of stages 3-4
  (``redteam/attacks/optimisation/factored.py``: <dW, O> and |dW|^2 from each layer's output gradient and input), the same
  value in another summation order (tested to 1e-6); breaching builds every weight gradient.

Measured, per model: restart-iterations per second of each optimisation loop (setup, the choice of the
winner and the warm-up excluded; the loop is timed from its first to its last step), the wall time of the
whole ``reconstruct`` call, the final SSIM of the returned reconstruction (``guardfl.redteam.modality.image.metrics.ssim``
against the private image, for both), and the wall time to reach a target SSIM: both loops are sampled
``--snapshots`` times per restart (the current iterate, clamped to the box; breaching samples after its
scheduler step, guardfl through its progress hook, which reads the engine's iterate), and the time to
target is the first sample of ANY restart with SSIM >= target, measured from the start of the first
restart's loop (an oracle choice of restart, the same rule for both). The default target (``--target-ssim
auto``) is the lower of the two final SSIMs, so both reach it; a number fixes it (e.g. 0.5). Sampling costs
a clone of the iterate (and a device sync on CUDA) every iterations/snapshots steps, on both sides.

Verdict per model: PASS when guardfl's restart-iterations per second are >= 2x breaching's and its final SSIM
is at least breaching's minus 0.05 ("equal quality"). Writes ``bench/results/vs_breaching.json`` (every
sample: time, iteration, restart, SSIM) and a PNG of the private image and both reconstructions.
Measured on a shared machine the numbers move with the load: run it alone.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from guardfl.redteam import FedSGD, ThreatModel, attacks, simulate_client
from guardfl.redteam.modality.image import metrics
from guardfl.redteam.attacks.optimisation import inverting_gradients as ig_module
from guardfl.redteam.attacks.compute import random_inputs, resolve_device
from guardfl.redteam.modality.image.models import LeNetZhu, resnet18_cifar, wide_init_

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "cifar10-train-5k.npz"
OUT = ROOT / "bench" / "results"
INSTALL = ('pip install --no-deps "breaching==0.1.2" "hydra-core==1.3.2" "omegaconf==2.3.0" '
           '"antlr4-python3-runtime==4.9.3"')
# default iterations per model and device type (a CPU run of ResNet-18 at 1,000 iterations x 4 restarts
# through breaching's sequential loop takes hours on 2 cores)
DEFAULT_ITERATIONS = {("lenet", "cpu"): 1000, ("resnet18", "cpu"): 100,
                      ("lenet", "cuda"): 2000, ("resnet18", "cuda"): 2000}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_model(name: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    if name == "lenet":
        return wide_init_(LeNetZhu((3, 32, 32), 10))
    if name == "resnet18":
        return resnet18_cifar((3, 32, 32), 10)
    raise SystemExit(f"--models: unknown model {name!r} (lenet, resnet18)")


def private_image(index: int, data: Path = DATA) -> tuple[torch.Tensor, torch.Tensor]:
    if not data.is_file():
        raise SystemExit(f"the CIFAR-10 sample is missing: {data} (--data)")
    d = np.load(data)
    x = torch.from_numpy(d["x"][index : index + 1]).permute(0, 3, 1, 2).float() / 255.0
    return x, torch.from_numpy(d["y"][index : index + 1]).long()


class Samples:
    """Timed samples of the iterates: (seconds since the first loop started, iteration, restart, image)."""

    def __init__(self, every: int, device: torch.device) -> None:
        self.every, self.device = every, device
        self.t0: float | None = None
        self.loop_seconds = 0.0
        self.rows: list[tuple[float, int, int, torch.Tensor]] = []

    def start(self) -> float:
        _sync(self.device)
        now = time.perf_counter()
        if self.t0 is None:
            self.t0 = now
        return now

    def take(self, iteration: int, restart: int, x: torch.Tensor) -> None:
        img = x.detach().clamp(0, 1).clone()
        _sync(self.device)
        self.rows.append((time.perf_counter() - self.t0, iteration, restart, img))


# -- guardfl ------------------------------------------------------------------------------------------------
class _GuardflProbe:
    """Stands in for the attack's progress bar: ``update`` is called by ``optimise_batched`` after every
    step; every ``every`` steps it reads the engine's current iterate ``x`` (R, n, ...) from the caller's
    frame and samples each restart."""

    def __init__(self, samples: Samples, total: int, x0: torch.Tensor) -> None:
        self.samples, self.total, self.x0 = samples, total, x0
        self.step = 0
        self.started = samples.start()
        self.stopped: float | None = None

    def update(self, n: int = 1) -> None:
        self.step += n
        if self.step == 1:
            start = sys._getframe(1).f_locals["x0"]
            if not torch.equal(start.cpu(), self.x0.cpu()):
                raise RuntimeError("guardfl did not start from the images handed to breaching")
        if self.step % self.samples.every == 0 or self.step == self.total:
            x = sys._getframe(1).f_locals["x"]
            if self.step == self.total:
                _sync(self.samples.device)
                self.stopped = time.perf_counter()
            for r in range(x.shape[0]):
                self.samples.take(self.step, r, x[r])

    def close(self) -> None:
        if self.stopped is None:
            _sync(self.samples.device)
            self.stopped = time.perf_counter()


def run_guardfl(obs, x0, args, iterations, device, samples: Samples | None):
    attack = attacks.get("inverting_gradients", iterations=iterations, restarts=x0.shape[0], lr=args.lr, tv=args.tv,
                         seed=args.seed, device=str(device), progress=samples is not None)
    probe: list[_GuardflProbe] = []
    original = ig_module.progress_bar

    def progress_bar(enabled, total, name):
        if not enabled:
            return None
        probe.append(_GuardflProbe(samples, total, x0))
        return probe[-1]

    ig_module.progress_bar = progress_bar
    try:
        _sync(device)
        t = time.perf_counter()
        rec = attack.reconstruct(obs, ThreatModel(labels="known"))
        _sync(device)
        wall = time.perf_counter() - t
    finally:
        ig_module.progress_bar = original
    loop = (probe[0].stopped - probe[0].started) if probe else None
    return rec.inputs.detach().cpu(), wall, loop


# -- breaching ----------------------------------------------------------------------------------------------
def breaching_config(iterations, restarts, args):
    import breaching

    overrides = [
        f"optim.max_iterations={iterations}", f"restarts.num_trials={restarts}", f"optim.step_size={args.lr}",
        f"regularization.total_variation.scale={args.tv}", "optim.optimizer=adam", "optim.signed=hard",
        "optim.boxed=True", "optim.step_size_decay=step-lr", "objective.type=cosine-similarity",
        "impl.dtype=float", "impl.mixed_precision=False",
    ]
    with contextlib.redirect_stdout(io.StringIO()):
        cfg = breaching.get_attack_config("invertinggradients", overrides=overrides)
    return cfg


def run_breaching(obs, model, x0, args, iterations, device, samples: Samples | None):
    import breaching
    from omegaconf import OmegaConf

    cfg = breaching_config(iterations, x0.shape[0], args)
    setup = dict(device=device, dtype=torch.float)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    if names != [n for n, _ in model.named_parameters()] or names != list(obs.param_names):
        raise RuntimeError("breaching matches gradients to model.parameters() in order: every parameter must be updated")
    metadata = OmegaConf.create(dict(name="guardfl-private-image", modality="vision", task="classification",
                                     shape=list(obs.input_shape), classes=obs.num_classes, normalize=False,
                                     mean=[0.0] * obs.input_shape[0], std=[1.0] * obs.input_shape[0]))
    payload = [dict(parameters=[p.detach().to(device) for p in obs.model.parameters()], buffers=None, metadata=metadata)]
    shared = [dict(gradients=[obs.update[n].detach().to(device) for n in names], buffers=None,
                   metadata=dict(num_data_points=obs.num_samples, labels=obs.side.labels.to(device),
                                 local_hyperparams=None))]
    attacker = breaching.attacks.prepare_attack(obs.model, torch.nn.CrossEntropyLoss(), cfg, setup)

    trial = {"r": -1}
    loops: list[tuple[float, float]] = []

    def initialize_data(data_shape):  # restart r starts from guardfl's restart r
        trial["r"] += 1
        candidate = x0[trial["r"]].to(device=device, dtype=torch.float).clone()
        assert list(candidate.shape) == list(data_shape)
        candidate.requires_grad = True
        candidate.grad = torch.zeros_like(candidate)
        return candidate

    init_optimizer = attacker._init_optimizer

    def wrapped_init_optimizer(params):
        optimizer, scheduler = init_optimizer(params)
        return optimizer, _Scheduler(scheduler, params[0], trial["r"], iterations, samples, loops)

    attacker._initialize_data = initialize_data
    attacker._init_optimizer = wrapped_init_optimizer
    _sync(device)
    t = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        out, _stats = attacker.reconstruct(payload, shared, {}, dryrun=False)
    _sync(device)
    wall = time.perf_counter() - t
    loop = sum(b - a for a, b in loops) if len(loops) == x0.shape[0] else None
    return out["data"].detach().cpu(), wall, loop


class _Scheduler:
    """breaching's LR scheduler, stepped once per iteration after the optimiser step: times the loop and
    samples the candidate (before breaching's box projection, hence the clamp in ``Samples.take``)."""

    def __init__(self, inner, candidate, restart, total, samples: Samples | None, loops) -> None:
        self.inner, self.candidate, self.restart, self.total, self.samples, self.loops = (
            inner, candidate, restart, total, samples, loops)
        self.step_no = 0
        self.started = samples.start() if samples is not None else time.perf_counter()

    def step(self, *a, **k):
        self.inner.step(*a, **k)
        self.step_no += 1
        if self.samples is not None and (self.step_no % self.samples.every == 0 or self.step_no == self.total):
            self.samples.take(self.step_no, self.restart, self.candidate)
        if self.step_no == self.total:
            if self.samples is not None:
                _sync(self.samples.device)
            self.loops.append((self.started, time.perf_counter()))

    def __getattr__(self, name):
        return getattr(self.inner, name)


# -- the comparison ------------------------------------------------------------------------------------------
def ssim_of(img: torch.Tensor, truth: torch.Tensor) -> float:
    return metrics.ssim(img.reshape(truth.shape).float().cpu(), truth, data_range=1.0)


def time_to(rows: list[dict], target: float) -> float | None:
    hits = [r["seconds"] for r in rows if r["ssim"] >= target]
    return min(hits) if hits else None


def compare(name: str, args, device) -> dict:
    iterations = args.iterations or DEFAULT_ITERATIONS[(name, device.type)]
    x, y = private_image(args.image, args.data)
    model = build_model(name, args.seed)
    obs = simulate_client(model, x, y, None, FedSGD())
    shape = (args.restarts, obs.num_samples, *obs.input_shape)
    x0 = random_inputs(shape, obs.input_range, torch.Generator(device="cpu").manual_seed(args.seed), device)
    every = max(1, iterations // args.snapshots)

    # warm-up (allocator, cuDNN/BLAS plans, TorchScript of breaching's objectives), then the timed runs
    run_guardfl(obs, x0, args, 2, device, None)
    run_breaching(obs, model, x0, args, 2, device, None)
    results = {}
    for side in args.order.split(","):
        samples = Samples(every, device)
        run = run_guardfl if side == "guardfl" else run_breaching
        call = (obs, x0, args, iterations, device, samples) if side == "guardfl" else (obs, model, x0, args, iterations, device, samples)
        rec, wall, loop = run(*call)
        truth = x[0]
        rows = [{"seconds": t, "iteration": it, "restart": r, "ssim": ssim_of(img, truth)} for t, it, r, img in samples.rows]
        results[side] = {
            "reconstruction": rec,
            "wall_seconds": wall,
            "loop_seconds": loop,
            "restart_it_per_s": args.restarts * iterations / loop if loop else None,
            "final_ssim": ssim_of(rec[0], truth),
            "samples": rows,
        }
    g, b = results["guardfl"], results["breaching"]
    finals = min(g["final_ssim"], b["final_ssim"])
    targets = [finals if t == "auto" else float(t) for t in args.target_ssim.split(",")]
    target_rows = []
    for spec, target in zip(args.target_ssim.split(","), targets):
        tg, tb = time_to(g["samples"], target), time_to(b["samples"], target)
        target_rows.append({"target": spec, "ssim": target, "guardfl_seconds": tg, "breaching_seconds": tb,
                            "ratio": (tb / tg) if (tg and tb) else None})
    speedup = g["restart_it_per_s"] / b["restart_it_per_s"]
    equal_quality = g["final_ssim"] >= b["final_ssim"] - 0.05
    row = {
        "model": name, "init": "wide U(-0.5, 0.5)" if name == "lenet" else "pytorch default",
        "image_index": args.image, "label": int(y[0]), "iterations": iterations, "restarts": args.restarts,
        "tv": args.tv, "lr": args.lr, "snapshot_every": every,
        "speedup_it_per_s": speedup, "equal_quality": equal_quality,
        "verdict": "PASS" if speedup >= 2 and equal_quality else "MISS",
        "time_to_ssim": target_rows,
        **{f"{side}": {k: v for k, v in res.items() if k != "reconstruction"} for side, res in results.items()},
    }
    row["_images"] = {"private": x, "guardfl": g["reconstruction"], "breaching": b["reconstruction"]}
    return row


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def fmt(v, spec=".2f", none="n/r"):
    return none if v is None else format(v, spec)


def print_row(r, device):
    g, b = r["guardfl"], r["breaching"]
    print(f"\n{device.type}  {r['model']} ({r['init']}), {r['iterations']} iterations x {r['restarts']} restarts, TV {r['tv']}")
    print(f"  {'':10s} {'restart-it/s':>12s} {'loop s':>8s} {'wall s':>8s} {'final SSIM':>10s}")
    for side, res in (("guardfl", g), ("breaching", b)):
        print(f"  {side:10s} {fmt(res['restart_it_per_s'], '12.2f'):>12s} {fmt(res['loop_seconds'], '8.2f'):>8s} "
              f"{res['wall_seconds']:8.2f} {res['final_ssim']:10.3f}")
    print(f"  ratio      {r['speedup_it_per_s']:11.2f}x {'':8s} {b['wall_seconds'] / g['wall_seconds']:7.2f}x "
          f"{g['final_ssim'] - b['final_ssim']:+10.3f}")
    for t in r["time_to_ssim"]:
        print(f"  time to SSIM >= {t['ssim']:.3f} ({t['target']}): guardfl {fmt(t['guardfl_seconds'])} s, "
              f"breaching {fmt(t['breaching_seconds'])} s, ratio {fmt(t['ratio'])}x")
    print(f"  [{r['verdict']}: guardfl >= 2x breaching's restart-iterations/s at equal quality "
          f"(SSIM within 0.05)]", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="lenet,resnet18")
    ap.add_argument("--iterations", type=int, default=None,
                    help="per restart; default: LeNet 1000 on CPU, 2000 on CUDA; ResNet-18 100 on CPU, 2000 on CUDA")
    ap.add_argument("--restarts", type=int, default=4)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--tv", type=float, default=1e-2, help="TV weight on both sides (guardfl's default; breaching's is 0.2)")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--data", type=Path, default=DATA, help="the CIFAR-10 sample (npz: x uint8 NHWC, y)")
    ap.add_argument("--image", type=int, default=0, help="index of the private image in the CIFAR-10 sample")
    ap.add_argument("--seed", type=int, default=0, help="model weights and starting images")
    ap.add_argument("--snapshots", type=int, default=25, help="samples of the iterate per restart")
    ap.add_argument("--target-ssim", default="auto,0.5",
                    help="comma list; auto = the lower of the two final SSIMs")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: leave as is)")
    ap.add_argument("--order", default="guardfl,breaching", help="which side runs first")
    ap.add_argument("--json", default=str(OUT / "vs_breaching.json"))
    args = ap.parse_args(argv)
    if sorted(args.order.split(",")) != ["breaching", "guardfl"]:
        raise SystemExit("--order: guardfl,breaching or breaching,guardfl")
    # breaching 0.1.2 scripts its objectives with torch.jit (deprecated in torch 2.x) and calls hydra without
    # version_base: both only warn
    warnings.filterwarnings("ignore", message=".*torch.jit.script.*", category=FutureWarning)
    warnings.filterwarnings("ignore", message="(?s).*version_base", category=UserWarning)
    try:
        import breaching  # noqa: F401
    except ImportError as exc:
        raise SystemExit(f"breaching is not installed ({exc}); install it without touching torch:\n  {INSTALL}")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    rows = []
    for name in args.models.split(","):
        rows.append(compare(name.strip(), args, device))
        print_row(rows[-1], device)

    import breaching as _b
    from importlib.metadata import version

    info = {
        "device": str(device), "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
        "torch": torch.__version__, "breaching": version("breaching"), "threads": torch.get_num_threads(),
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "breaching_path": str(Path(_b.__file__).parent),
    }
    images = {}
    for r in rows:
        im = r.pop("_images")
        images[f"{r['model']}: private, guardfl, breaching"] = torch.cat([im["private"], im["guardfl"], im["breaching"]])
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**info, "command": " ".join(sys.argv), "rows": rows}, indent=2))
        try:
            sys.path.insert(0, str(Path(__file__).parent))
            from bench_attacks import save_grid

            save_grid(images, path.with_suffix(".png"))
        except Exception as exc:  # the figure is a convenience
            print(f"(no PNG: {exc})")
        print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
