"""jamp.train.stop: SIGTERM and Ctrl-C become a request to stop after the current step."""

import os
import signal

from jamp.train.stop import StopFlag


def test_stop_flag_turns_sigterm_into_a_stop_request_and_restores_the_handler():
    before = signal.getsignal(signal.SIGTERM)
    with StopFlag(every=5) as stop:
        assert not stop.should_stop(1)
        os.kill(os.getpid(), signal.SIGTERM)  # handled: the process goes on
        assert stop.should_stop(2) and stop.signal == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is before


def test_stop_flag_catches_ctrl_c():
    before = signal.getsignal(signal.SIGINT)
    with StopFlag() as stop:
        os.kill(os.getpid(), signal.SIGINT)  # no KeyboardInterrupt
        assert stop.should_stop(1) and stop.signal == "SIGINT"
    assert signal.getsignal(signal.SIGINT) is before
