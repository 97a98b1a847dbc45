import pytest
import torch

from guardfl.defenses import GradPrune
from guardfl.redteam import FedAvg, FedSGD, ThreatModel, simulate_client
from guardfl.redteam.attacks.optimisation import objectives as obj
from guardfl.redteam.attacks.optimisation.engine import ObjectiveWeights, Replica
from guardfl.redteam.attacks.optimisation.optimiser import lr_at, optimise_batched


@pytest.mark.parametrize(
    "protocol", [FedSGD(), FedAvg(epochs=2, batch_size=1, lr=0.1, momentum=0.9, weight_decay=1e-3)]
)
def test_replica_reproduces_the_client_exactly_at_the_truth(wide_lenet, faces, protocol):
    x, y = faces[:2], torch.tensor([1, 2])
    obs = simulate_client(wide_lenet, x, y, None, protocol)
    replica = Replica(obs, ThreatModel(labels="known").knowledge(obs), ObjectiveWeights("cosine"), torch.device("cpu"))
    for a, b in zip(replica.simulate(x, y), replica.observed):
        assert torch.allclose(a, b, atol=1e-6)
    assert float(replica.objective(x, y)) == pytest.approx(0.0, abs=1e-5)  # float32 rounding


@pytest.mark.parametrize("train_mode", [True, False])
def test_the_replica_of_a_batchnorm_client_runs_in_the_clients_mode(faces, train_mode):
    from guardfl.redteam.modality.image.models import ConvNetSmall

    torch.manual_seed(0)
    model = ConvNetSmall((1, 25, 25), 10)
    with torch.no_grad():  # running statistics that differ from any batch's
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    x, y = faces[:3], torch.tensor([1, 2, 3])
    obs = simulate_client(model, x, y, train_mode=train_mode)
    replica = Replica(obs, ThreatModel(labels="known").knowledge(obs), ObjectiveWeights("cosine"), torch.device("cpu"))
    for a, b in zip(replica.simulate(x, y), replica.observed):
        assert torch.allclose(a, b, atol=1e-5)


def test_pruned_update_is_matched_on_its_nonzero_coordinates(wide_lenet, faces):
    x, y = faces[:1], torch.tensor([3])
    obs = simulate_client(wide_lenet, x, y, GradPrune(0.9))
    replica = Replica(obs, ThreatModel(labels="known").knowledge(obs), ObjectiveWeights("cosine"), torch.device("cpu"))
    assert replica.masks is not None
    # at the truth the kept coordinates agree exactly, so the masked cosine distance is ~0
    assert float(replica.objective(x, y)) == pytest.approx(0.0, abs=1e-5)
    unaware = Replica(obs, ThreatModel(labels="known", defense="unknown").knowledge(obs), ObjectiveWeights("cosine"), torch.device("cpu"))
    assert float(unaware.objective(x, y)) > 0.01


def test_sign_hinge_is_zero_iff_signs_agree():
    g = torch.tensor([0.5, -2.0, 0.1])
    assert float(obj.sign_hinge_distance(g, torch.tensor([1.0, -1.0, 1.0]))) == 0
    assert float(obj.sign_hinge_distance(g, torch.tensor([-1.0, -1.0, 1.0]))) == pytest.approx(0.25)


def test_lr_schedule_drops_at_three_eighths_five_eighths_seven_eighths():
    assert [lr_at(s, 80, 0.1) for s in (0, 29, 30, 50, 70, 79)] == pytest.approx([0.1, 0.1, 0.01, 0.001, 1e-4, 1e-4])


def test_sign_aware_objective_is_zero_at_the_truth_for_one_sample(wide_lenet, faces):
    from guardfl.defenses import SignCompression

    x, y = faces[:1], torch.tensor([3])
    obs = simulate_client(wide_lenet, x, y, SignCompression())
    replica = Replica(obs, ThreatModel(labels="known").knowledge(obs), ObjectiveWeights("cosine"), torch.device("cpu"))
    assert replica.hinge and float(replica.objective(x, y)) == 0.0
    batch = simulate_client(wide_lenet, faces[:2], torch.tensor([3, 4]), SignCompression())
    assert not Replica(batch, ThreatModel(labels="known").knowledge(batch), ObjectiveWeights(), torch.device("cpu")).hinge


def test_replica_reproduces_noiseless_dpsgd_exactly():
    """The clipping-aware objective: the attacker's replica clips each sample's gradient as Opacus does."""
    from guardfl.defenses import DPSGD
    from guardfl.redteam.attacks.optimisation.engine import ObjectiveWeights, Replica
    from guardfl.redteam.client.simulate import FedAvg, FedSGD, simulate_client
    from guardfl.redteam.threat import ThreatModel

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    x, y = torch.rand(4, 3, 2, 2), torch.tensor([0, 1, 2, 1])
    for protocol in (FedSGD(), FedAvg(epochs=2, batch_size=2, lr=0.1)):
        obs = simulate_client(model, x, y, DPSGD(noise_multiplier=0.0, max_grad_norm=0.02, poisson_sampling=False), protocol)
        replica = Replica(obs, ThreatModel(labels="known").knowledge(obs), ObjectiveWeights(distance="l2"), torch.device("cpu"))
        for sim, seen in zip(replica.simulate(x, y), replica.observed):
            assert torch.allclose(sim, seen, atol=1e-7)


def test_adam_step_is_torch_adam_with_the_step_decay():
    """The in-place step the (possibly CUDA-graphed) loop replays is Adam (torch's update, betas 0.9/0.999,
    eps 1e-8) with Geiping et al.'s step decay, then the box projection."""
    from guardfl.redteam.attacks.optimisation.optimiser import _schedule, adam_step_, lr_at

    gen = torch.Generator().manual_seed(0)
    x = torch.rand(2, 1, 5, 5, generator=gen)
    grads = [torch.randn(2, 1, 5, 5, generator=gen) for _ in range(16)]
    ref = x.clone().requires_grad_(True)
    opt = torch.optim.Adam([ref], lr=0.1)
    ours, m, v = x.clone(), torch.zeros_like(x), torch.zeros_like(x)
    for i, g in enumerate(grads):
        for group in opt.param_groups:
            group["lr"] = lr_at(i, len(grads), 0.1)
        ref.grad = g.clone()
        opt.step()
        with torch.no_grad():
            ref.clamp_(-0.5, 1.5)
        a, b = _schedule(i, len(grads), 0.1)
        adam_step_(ours, g, m, v, torch.tensor(a), torch.tensor(b), (-0.5, 1.5), signed=False)
    assert torch.allclose(ours, ref.detach(), atol=1e-6)


def test_cuda_graph_recording_falls_back_to_the_eager_loop_without_cuda():
    from guardfl.redteam.attacks.optimisation.optimiser import record_cuda_graph

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    state = (torch.arange(4.0),)
    with pytest.warns(RuntimeWarning, match="CUDA graph recording failed"):
        assert record_cuda_graph(lambda: state[0].add_(1), state) is None
    assert state[0].tolist() == [0.0, 1.0, 2.0, 3.0]
    # asked for explicitly on a CPU: the same result as the eager loop, with the warning
    f = lambda x, a: (x - 0.3).pow(2).sum()  # noqa: E731
    x0 = torch.zeros(2, 1, 3, 3)
    eager = optimise_batched(f, x0, iterations=5, lr=0.1, bounds=(0, 1))
    with pytest.warns(RuntimeWarning):
        forced = optimise_batched(f, x0, iterations=5, lr=0.1, bounds=(0, 1), cuda_graph=True)
    assert torch.equal(eager, forced)


def test_cudnn_autotuning_is_on_for_the_optimisation_only_and_restored():
    seen = []

    def f(x, a):
        seen.append(torch.backends.cudnn.benchmark)
        return (x - 0.3).pow(2).sum()

    before = torch.backends.cudnn.benchmark
    x0 = torch.zeros(2, 1, 3, 3)
    plain = optimise_batched(f, x0, iterations=3, lr=0.1, bounds=(0, 1))  # a CPU tensor: not asked
    assert seen == [False] * 3 and torch.backends.cudnn.benchmark == before
    seen.clear()
    tuned = optimise_batched(f, x0, iterations=3, lr=0.1, bounds=(0, 1), autotune=True)
    assert seen == [True] * 3 and torch.backends.cudnn.benchmark == before
    assert torch.equal(plain, tuned)  # no convolution here: the same arithmetic


def test_restarts_as_separate_forwards_give_the_vmapped_result(wide_lenet, faces):
    """``vmap_restarts=False`` (large models on a CPU) sums R ordinary objectives: the same gradients."""
    from guardfl.redteam.attacks.optimisation.engine import restarts_vmapped

    obs = simulate_client(wide_lenet, faces[:2], torch.tensor([2, 4]))
    knowledge = ThreatModel(labels="known").knowledge(obs)
    replica = Replica(obs, knowledge, ObjectiveWeights("cosine", tv=1e-2, group=1e-2), torch.device("cpu"))
    f = lambda x, a: replica.objective(x, knowledge.labels, a)  # noqa: E731
    x0 = torch.rand(3, 2, 1, 25, 25, generator=torch.Generator().manual_seed(0))
    kw = dict(iterations=20, lr=0.1, bounds=(0, 1), group_every=5)
    assert torch.allclose(optimise_batched(f, x0, **kw), optimise_batched(f, x0, vmap_restarts=False, **kw), atol=1e-5)
    assert restarts_vmapped(wide_lenet, torch.device("cpu")) and restarts_vmapped(wide_lenet, torch.device("cuda"))
    from guardfl.redteam.modality.image.models import resnet18_cifar

    big = resnet18_cifar((3, 32, 32), 10)
    assert not restarts_vmapped(big, torch.device("cpu")) and restarts_vmapped(big, torch.device("cuda"))
