"""``ray_connection._sigint_deferred``, the guard around every Ray call of a driver (issue 36): a Ctrl-C
during the block is raised after it, also when code inside took SIGINT over and dropped it (Ray's own
``DeferSigint`` drops a SIGINT when an exception passes through its context: the cause of a Ctrl-C lost
while ``ray.init`` was starting) or caught the ``KeyboardInterrupt`` itself."""

import os
import signal
import time

import pytest

from guardfl.redteam.runtime.ray_connection import _sigint_deferred, reachable


def _ctrl_c() -> None:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)  # the handler runs in the main thread at the next bytecode


def _ray_drops_it() -> None:
    """What Ray's DeferSigint does with a SIGINT when an error passes through its context: forgets it."""
    from ray._private.utils import DeferSigint

    try:
        with DeferSigint():
            _ctrl_c()
            raise RuntimeError("an error inside Ray's deferred section")
    except RuntimeError:
        pass


def _swallows_it() -> None:
    try:
        _ctrl_c()
    except BaseException:  # noqa: BLE001 (what library code sometimes does)
        pass


def test_without_the_guard_ray_loses_the_ctrl_c():
    pytest.importorskip("ray")
    _ray_drops_it()  # nothing raised: the bug the guard is for


@pytest.mark.parametrize("block", [_ray_drops_it, _swallows_it])
def test_a_ctrl_c_lost_inside_the_block_is_raised_after_it(block):
    if block is _ray_drops_it:
        pytest.importorskip("ray")
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        with _sigint_deferred():
            block()
    assert signal.getsignal(signal.SIGINT) is before
    assert signal.set_wakeup_fd(-1) == -1  # the wakeup fd is put back (none was set)


def test_a_ctrl_c_wins_over_an_error_of_the_block_and_none_is_invented():
    with pytest.raises(KeyboardInterrupt) as err:
        with _sigint_deferred():
            _ctrl_c()
            raise ConnectionError("ray.init failed")
    assert isinstance(err.value.__cause__, ConnectionError)
    with pytest.raises(ConnectionError):
        with _sigint_deferred():
            raise ConnectionError("no Ctrl-C: the block's own error")
    with _sigint_deferred():
        pass


def test_local_and_auto_are_left_to_ray():
    assert reachable("local") is None and reachable("auto") is None
    assert "expected host:port" in reachable("nohost")


def test_a_local_instance_runs_its_workers_at_the_drivers_priority(monkeypatch):
    """Ray renices workers to 15 by default; on a 2-core host with one other busy process they starved (a
    Flower simulation stalled in round 1 for 10 minutes in CI). A local instance of ours is the work: nice 0."""
    pytest.importorskip("ray")
    from guardfl.redteam.runtime.ray_connection import Ray

    monkeypatch.delenv("RAY_worker_niceness", raising=False)
    backend = Ray(workers=1, address="local")
    try:
        backend.submit("k", lambda _: os.nice(0), None)  # a lambda travels by value; os.nice(0) reads the niceness
        assert backend.next_done() == ("k", os.nice(0))
    finally:
        backend.close()
