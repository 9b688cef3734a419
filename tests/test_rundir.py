"""Stable run directories: the same command always names the same directory; watch-only overrides do not."""

from __future__ import annotations

from launcher.rundir import MAX_TAG, run_tag


def test_no_overrides_is_the_default_run():
    assert run_tag([]) == "default"
    assert run_tag(["+experiment=lenet", "hydra.run.dir=x"]) == "default"


def test_overrides_that_change_the_result_name_the_run_in_a_stable_order():
    a = run_tag(["optim.lr=0.1", "data.batch_size=64"])
    assert a == run_tag(["data.batch_size=64", "optim.lr=0.1"]) == "data.batch_size=64,optim.lr=0.1"


def test_watch_only_overrides_keep_the_same_run_so_it_resumes():
    base = run_tag(["optim.lr=0.1"])
    assert run_tag(["optim.lr=0.1", "trainer.max_steps=500", "trainer.progress=lines", "launcher.max_restarts=3"]) == base
    assert run_tag(["optim.lr=0.1", "checkpoint.keep_last=1"]) == base


def test_another_data_root_is_another_run():
    """Data read from elsewhere is other data: its run must not resume the checkpoints trained on the first."""
    assert run_tag(["data=tokens", "data.root=data/openwebtext"]) != run_tag(["data=tokens", "data.root=data/mine"])


def test_names_are_safe_and_bounded():
    assert "/" not in run_tag(["model.hidden=[64, 32]", "data.name=a/b"])
    long = run_tag([f"model.hidden=[{','.join(['512'] * 80)}]"])
    assert len(long) == MAX_TAG
    assert long != run_tag([f"model.hidden=[{','.join(['512'] * 81)}]"])  # the hash keeps them apart
