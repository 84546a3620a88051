"""Outside torchrun the distributed helpers are plain single-process no-ops (the two-process
path is checked by test_train.test_ddp_two_processes_equal_one)."""

from training.cdk import distributed


def test_single_process_defaults(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert distributed.init_from_env() is None
    assert distributed.rank_and_world() == (0, 1)
    calls = []
    assert distributed.main_first(lambda: calls.append(1) or "done") == "done"
    assert calls == [1]  # rank 0 only, once
    distributed.barrier()
    distributed.shutdown()
