"""jamp.train.steps: the loop's train step, and which of its calls compiles a program."""

from jamp.train import steps as steps_lib
from jamp.train.steps import Placement, Steps


def _fake_placement(monkeypatch, plain):
    # Stands in for pmap / the mesh: each "program" answers which step function it was built from.
    def place_steps(run, make_step, make_eval, state):
        kind = "plain" if make_step is plain else "calibrating"
        return Placement(
            place=lambda s: s,
            batch=lambda b: b,
            train_step=lambda s, b, r: (s, kind),
            eval_step=None,
            fetch=lambda m: m,
            host=lambda s: s,
        )

    monkeypatch.setattr(steps_lib, "place_steps", place_steps)


def _plain(axis_name):
    return None


def test_steps_take_the_calibrating_step_first_and_know_which_calls_compile(monkeypatch):
    _fake_placement(monkeypatch, _plain)
    steps = Steps(None, _plain, _plain, "state", calibrate=True, start=0)
    assert steps.compiles(0)
    assert steps("state", "batch", None, 0) == ("state", "calibrating")
    assert steps.compiles(1)  # the plain step's first call
    assert steps("state", "batch", None, 1) == ("state", "plain")
    assert not steps.compiles(2)
    assert steps("state", "batch", None, 2) == ("state", "plain")


def test_steps_rebuilt_for_a_new_model_compile_on_their_next_call(monkeypatch):
    _fake_placement(monkeypatch, _plain)
    steps = Steps(None, _plain, _plain, "state", calibrate=False, start=10)
    assert steps.compiles(10) and not steps.compiles(11)
    steps.rebuild("state", calibrate=False, step=20)  # a precision change after step 20
    assert steps.compiles(20) and not steps.compiles(21)
    steps.rebuild("state", calibrate=True, step=30)  # a module back in fp8: calibrate first
    assert steps.compiles(30)
    assert steps("state", "batch", None, 30) == ("state", "calibrating")
    assert steps.compiles(31) and not steps.compiles(32)
