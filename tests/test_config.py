"""Composition and validation: every preset composes; bad configs fail before any process starts, saying
which key is wrong and how to fix it."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from conftest import CONF_DIR, run_cli, typed
from launcher.schema import Config
from launcher.checks.validate import ConfigError, validate
from train.config import TrainConfig, load_config

EXPERIMENTS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))


def test_the_presets_the_issue_names_exist():
    assert {"digits", "lenet", "resnet18", "gpt_tiny", "gpt2_124m"} <= set(EXPERIMENTS)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes_into_the_typed_schema(experiment):
    cfg = typed(f"+experiment={experiment}")
    assert isinstance(cfg, Config)
    assert cfg.name == experiment
    assert cfg.model["_target_"].startswith(("train.models.vision.", "train.models.gpt.")) and cfg.task["_target_"].startswith("train.tasks.")


def test_presets_pick_their_model_and_data():
    resnet = typed("+experiment=resnet18")
    assert (resnet.model["_target_"], resnet.data.name, resnet.model["width"]) == ("train.models.vision.resnet18", "cifar10", 64)
    assert (resnet.model["channels"], resnet.model["image_size"]) == (3, 32)  # from the data's shape
    lenet = typed("+experiment=lenet")
    assert (lenet.model["_target_"], lenet.data.name, lenet.data.train["_target_"]) == (
        "train.models.vision.lenet", "fashion_mnist", "train.data.sets.fashion_mnist")


def test_the_default_job_is_the_digits_preset_on_two_cpu_processes():
    default, digits = typed(), typed("+experiment=digits")
    assert default == digits
    assert (default.trainer.gpus, default.trainer.procs_per_node, default.data.name) == (0, 2, "digits")


@pytest.mark.parametrize("group", ["model", "data", "task", "optim", "trainer"])
def test_every_group_option_composes(group):
    for option in sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml")):
        cfg = typed(f"{group}={option}")
        assert isinstance(cfg, Config)


def test_a_value_left_unset_is_asked_for_before_start(launch, tmp_path):
    proc = launch("model.width=???", f"hydra.run.dir={tmp_path / 'run'}", timeout=120)  # as a project's YAML may
    assert proc.returncode == 2
    assert "the config leaves model.width unset (??? in its file): give it on the command line, e.g. model.width=..." \
           in proc.stderr


def test_an_image_folder_is_checked_before_start(launch, tmp_path):
    from test_data import write_image_folder

    proc = launch("data=image_folder", f"data.root={tmp_path / 'nowhere'}", f"hydra.run.dir={tmp_path / 'run'}", timeout=120)
    assert proc.returncode == 2 and f"{tmp_path / 'nowhere' / 'train'} holds no class sub-folders" in proc.stderr
    write_image_folder(tmp_path / "images" / "train", per_class=2)
    write_image_folder(tmp_path / "images" / "eval", per_class=2)
    proc = launch("data=image_folder", f"data.root={tmp_path / 'images'}", f"hydra.run.dir={tmp_path / 'run'}", timeout=120)
    assert proc.returncode == 2 and "data.num_classes=10, but" in proc.stderr and "set data.num_classes=3" in proc.stderr


def test_misspelt_key_fails_at_composition():
    with pytest.raises(ConfigCompositionException) as info:
        typed("trainer.epoch=3")
    assert "Key 'epoch' not in 'TrainerConfig'" in str(info.value.__cause__)


def test_misspelt_key_added_with_plus_fails_too():
    with pytest.raises(ConfigError) as info:
        typed("+trainer.epoch=3")
    assert "trainer.epoch is not a config key" in str(info.value)


def test_wrong_type_fails_at_composition():
    with pytest.raises(ConfigCompositionException) as info:
        typed("trainer.epochs=many")
    assert isinstance(info.value.__cause__, ValidationError)
    assert "trainer.epochs" in str(info.value.__cause__)


def problems(*overrides: str, run_dir: Path, cuda_devices: int = 0) -> str:
    cfg = typed(*overrides)
    cfg.data.root = str(run_dir / "data")
    with pytest.raises(ConfigError) as info:
        validate(cfg, run_dir, cuda_devices=cuda_devices)
    return str(info.value)


def test_more_gpus_than_present(tmp_path):
    message = problems("trainer.gpus=4", run_dir=tmp_path, cuda_devices=1)
    assert "trainer.gpus=4" in message and "1 CUDA device" in message and "trainer.gpus=0" in message


def test_nccl_without_cuda(tmp_path):
    message = problems("trainer.backend=nccl", run_dir=tmp_path)
    assert "trainer.backend=nccl needs CUDA GPUs" in message and "trainer.backend=gloo" in message


def test_batch_size_below_one(tmp_path):
    assert "data.batch_size=0 must be at least 1" in problems("data.batch_size=0", run_dir=tmp_path)


def test_a_step_limit_of_zero_or_below_minus_one_and_a_nan_lr_are_refused(tmp_path):
    """trainer.max_steps=0 (or -5) trained every epoch without a word; optim.lr=nan was accepted."""
    for steps in (0, -5):
        message = problems(f"trainer.max_steps={steps}", run_dir=tmp_path)
        assert f"trainer.max_steps={steps}: give the optimizer steps to stop after (1 or more), or -1" in message
    assert "optim.lr=nan must be a finite number, 0 or more" in problems("optim.lr=nan", run_dir=tmp_path)
    assert "optim.lr=-0.1 must be a finite number" in problems("optim.lr=-0.1", run_dir=tmp_path)


def test_a_profiled_range_must_be_two_steps_in_order(tmp_path):
    assert "trainer.profile=[5, 3] must be [FIRST,LAST] optimizer steps with 1 <= FIRST <= LAST" in \
        problems("trainer.profile=[5,3]", run_dir=tmp_path)


def test_bad_checkpoint_and_sharding_settings_are_refused_with_the_fix(tmp_path):
    message = problems("checkpoint.format=zip", "checkpoint.async_save=true", run_dir=tmp_path)
    assert "checkpoint.format='zip' is not one of: auto, file, dcp" in message
    message = problems("checkpoint.async_save=true", run_dir=tmp_path)  # ddp: auto means file
    assert "checkpoint.async_save=true writes step directories: add checkpoint.format=dcp" in message
    message = problems("trainer.strategy=fsdp", "trainer.procs_per_node=4", "trainer.fsdp_replicate=3", run_dir=tmp_path)
    assert "trainer.fsdp_replicate=3: the copies of the sharded model must divide the world size (4 processes)" in message


def test_a_misspelt_model_argument_is_named_with_the_fix(tmp_path):
    message = problems("+model.widht=8", run_dir=tmp_path)
    assert "model.widht: train.models.vision.cnn has no argument 'widht' (did you mean model.width?)" in message


def test_a_tracker_is_checked_like_any_target(tmp_path):
    message = problems("+logger=wandb", "+loggers.wandb.projct=x", "+loggers.mine._target_=my_trackers.Tracker",
                       run_dir=tmp_path)
    assert "loggers.wandb.projct: train.observe.wandb_tracker.WandB has no argument 'projct' (did you mean " \
           "loggers.wandb.project?)" in message
    assert "loggers.mine._target_=my_trackers.Tracker cannot be imported: no module 'my_trackers'" in message
    cfg = typed("+logger=[wandb,mlflow]", "~loggers.tensorboard", "loggers.wandb.mode=offline")
    cfg.data.root = str(tmp_path / "data")
    validate(cfg, tmp_path, cuda_devices=0)  # both installed (the test extra), the default arguments fit
    assert set(cfg.loggers) == {"wandb", "mlflow"}


def test_a_bad_lr_schedule_is_refused_with_the_fix(tmp_path):
    assert "optim.schedule: optim.schedule.name='linear' is not a schedule: pick one of cosine, step, constant." in \
        problems("optim.schedule.name=linear", run_dir=tmp_path)
    message = problems("optim.schedule._target_=torch.optim.lr_scheduler.CosineAnnealingLR", run_dir=tmp_path)
    assert "is a torch scheduler" in message and "returns factor(step) -> float" in message
    message = problems("~optim/schedule", run_dir=tmp_path)
    assert "optim.schedule must be a node with a _target_" in message


def test_an_iterable_data_set_without_a_length_is_refused(tmp_path):
    message = problems("data.train._target_=torch.utils.data.IterableDataset", run_dir=tmp_path)
    assert "data.train._target_=torch.utils.data.IterableDataset is an IterableDataset without __len__: define __len__" in message


def test_missing_data_set_says_where_and_how(tmp_path):
    message = problems("+experiment=lenet", run_dir=tmp_path)
    assert "data.name=fashion_mnist" in message
    assert str(tmp_path / "data" / "FashionMNIST" / "raw") in message  # where the files are expected
    assert "train-images-idx3-ubyte" in message and "data.download=true" in message  # what and how


def test_fp16_on_cpu_and_multi_node_without_endpoint(tmp_path):
    message = problems("trainer.precision=fp16", "trainer.nodes=2", run_dir=tmp_path)
    assert "trainer.precision=fp16 needs GPUs" in message
    assert "launcher.rdzv_endpoint=HOST:PORT" in message


def test_all_problems_are_reported_at_once(tmp_path):
    message = problems("data.batch_size=0", "trainer.accumulate=0", "optim.lr=-1", run_dir=tmp_path)
    assert "data.batch_size" in message and "trainer.accumulate" in message and "optim.lr" in message


def test_performance_options_are_checked(tmp_path):
    message = problems("trainer.grad_compression=int8", "trainer.memory_format=nhwc", "trainer.stop_check_s=0",
                       "trainer.bucket_cap_mb=0", run_dir=tmp_path)
    assert "trainer.grad_compression='int8' is not one of: none, bf16, fp16" in message
    assert "trainer.memory_format='nhwc' is not one of: auto, channels_last, contiguous" in message
    assert "trainer.stop_check_s=0.0 must be above 0" in message
    assert "trainer.bucket_cap_mb=0 must be at least 1" in message
    assert "trainer.profile_ranks=[0, 2]: [2] not a rank of the 2 processes" in problems(
        "trainer.profile=[3,4]", "trainer.profile_ranks=[0,2]", run_dir=tmp_path)


def test_strategy_combinations_are_checked_before_start(tmp_path):
    message = problems("trainer.strategy=pipeline", "trainer.procs_per_node=1", "data.batch_size=30", run_dir=tmp_path)
    assert "trainer.strategy=pipeline needs at least 2 stages" in message
    assert "data.batch_size=30 does not split into trainer.microbatches=4 equal microbatches" in message
    message = problems("trainer.strategy=pipeline", "trainer.procs_per_node=3", "trainer.microbatches=2", run_dir=tmp_path)
    assert "trainer.pipeline_schedule=1f1b needs at least as many microbatches as stages (3)" in message
    message = problems("trainer.strategy=pipeline", "trainer.procs_per_node=4", run_dir=tmp_path)  # the cnn has 3 blocks
    assert "model._target_=train.models.vision.cnn declares 3 block(s): use 3 stages or fewer" in message
    message = problems("trainer.strategy=pipeline", "trainer.procs_per_node=4", "trainer.pp=3", run_dir=tmp_path)
    assert "trainer.pp=3: the pipeline's stages must divide the world size (4 processes): pick a divisor of 4" in message
    validate(typed("trainer.strategy=pipeline", "trainer.procs_per_node=4", "trainer.pp=2", "trainer.microbatches=2"),
             tmp_path, cuda_devices=0)  # 2 stages x 2 copies
    message = problems("trainer.strategy=fsdp", "trainer.grad_compression=bf16", "trainer.fsdp_cpu_offload=true", run_dir=tmp_path)
    assert "trainer.grad_compression=bf16 applies to trainer.strategy=ddp only" in message
    assert "trainer.fsdp_cpu_offload=true needs trainer.strategy=fsdp on GPUs" in message
    assert "trainer.strategy='zero' is not one of: ddp, fsdp, pipeline" in problems("trainer.strategy=zero", run_dir=tmp_path)
    message = problems("trainer.strategy=pipeline", "trainer.procs_per_node=2", "trainer.sync_batchnorm=true", run_dir=tmp_path)
    assert "trainer.sync_batchnorm=true gathers BatchNorm statistics over every rank, which trainer.strategy=pipeline" in message
    validate(typed("trainer.strategy=fsdp", "trainer.procs_per_node=2", "trainer.sync_batchnorm=true"), tmp_path, cuda_devices=0)
    validate(typed("trainer.strategy=pipeline", "trainer.procs_per_node=3"), tmp_path, cuda_devices=0)  # 3 blocks, 3 stages


def test_valid_default_config_passes(tmp_path):
    validate(typed(), tmp_path, cuda_devices=0)


def test_snapshot_round_trips_through_the_worker_schema(tmp_path):
    from omegaconf import OmegaConf

    cfg = typed("data.batch_size=7", "launcher.max_restarts=2")
    OmegaConf.save(OmegaConf.structured(cfg), tmp_path / "config.yaml")
    loaded = load_config(tmp_path / "config.yaml")
    assert isinstance(loaded, TrainConfig) and loaded.data.batch_size == 7
    assert not hasattr(loaded, "launcher")  # the worker ignores the launcher's section


def test_a_snapshot_of_an_earlier_version_still_loads(tmp_path):
    """An older run directory's config.yaml holds trainer.stop_check_every, which this version replaced."""
    from omegaconf import OmegaConf

    from train.config import TrainConfig, load_config

    snapshot = OmegaConf.structured(TrainConfig)
    raw = OmegaConf.to_container(snapshot)
    raw["trainer"].pop("stop_check_s")
    raw["trainer"]["stop_check_every"] = 10
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(raw))
    assert load_config(tmp_path / "config.yaml").trainer.stop_check_s == 5.0


def test_a_target_the_trainer_calls_later_without_partial_is_refused_with_the_fix(tmp_path):
    """Without _partial_ Hydra calls the optimizer (without parameters) or the collate function (without samples) while
    building the config: a TypeError in every worker before."""
    assert "optim.optimizer._target_=torch.optim.SGD is called by the trainer later (with the parameter groups and " \
           "lr=), so the config must not call it now: add `_partial_: true`" in \
        problems("~optim.optimizer._partial_", run_dir=tmp_path)
    assert "data.collate_fn._target_=torch.utils.data.default_collate is called by the trainer later (with each " \
           "batch's list of samples)" in \
        problems("+data.collate_fn={_target_: torch.utils.data.default_collate}", run_dir=tmp_path)


def test_what_the_refusals_say_works_works_quoted_and_with_the_config_dir_after_the_overrides(tmp_path):
    """The catalogue (tests/conformance/test_mistakes.py) holds the refusals; here the command they point to runs:
    the user's experiment found with --config-dir (written after an override), a value with '=' quoted for Hydra."""
    (tmp_path / "conf" / "experiment").mkdir(parents=True)
    (tmp_path / "conf" / "experiment" / "mine.yaml").write_text("# @package _global_\nname: mine\n")
    quoted = run_cli("launcher", "+experiment=mine", 'hydra.run.dir="r=1"', "--config-dir", "conf",
                     "launcher.dry_run=true", cwd=tmp_path)
    assert quoted.returncode == 0, quoted.stderr[-2000:]
    assert (tmp_path / "r=1" / "config.yaml").is_file()
    assert "name: mine" in (tmp_path / "r=1" / "config.yaml").read_text()


@pytest.mark.parametrize("backend", [["launcher=slurm"], ["launcher=ray", "launcher.address=http://127.0.0.9:8265"]])
def test_a_dry_run_for_a_cluster_plans_without_the_cluster(tmp_path, backend):
    """docs: "plan it on your laptop". A dry run for SLURM or Ray was refused where no cluster answers."""
    env = {"SLURM_CONF": str(tmp_path / "no-slurm.conf"), "PATH": "/usr/bin:/bin"} if backend[0] == "launcher=slurm" else {}
    proc = run_cli("launcher", *backend, "trainer.nodes=2", "launcher.dry_run=true", f"hydra.run.dir={tmp_path / 'run'}",
                   cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "forecast  rank 0 of 4" in proc.stdout and "dry run: nothing started" in proc.stdout
    assert "cluster is not asked" in proc.stderr


def test_rays_error_text_is_cut_at_a_sentence_not_mid_word():
    from launcher.backends.ray import first_sentence

    text = ("Failed to make request to http://127.0.0.9:8265/api/v0/nodes. Failed to connect to API server. Make sure "
            "dependencies are installed with `pip install ray[default]`.")
    assert first_sentence(text) == "Failed to make request to http://127.0.0.9:8265/api/v0/nodes"
    assert first_sentence("word " * 100).endswith("word ...")


def test_wandb_online_without_a_login_is_refused_naming_the_offline_mode(tmp_path, monkeypatch):
    """Before: wandb.init failed in rank 0 after start, without a word of the offline mode."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc: `wandb login` was never run here
    message = problems("+logger=wandb", run_dir=tmp_path)
    assert "+logger=wandb logs online, but this machine has no W&B login for api.wandb.ai" in message
    assert "or log offline with loggers.wandb.mode=offline" in message
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password abc\n")
    (tmp_path / ".netrc").chmod(0o600)
    cfg = typed("+logger=wandb")
    cfg.data.root = str(tmp_path / "data")
    validate(cfg, tmp_path, cuda_devices=0)  # logged in: nothing to say


def test_hydras_options_are_taken_wherever_they_are_written():
    """`python -m launcher trainer.threads=1 --config-dir conf +experiment=mine` failed in Hydra's parser
    ("unrecognized arguments" for every override after the option); each option moves first with its value."""
    from launcher.__main__ import hydra_flags_first

    words = ["a=1", "--config-dir", "conf", "+experiment=x", "-m", "~b", "--cfg", "job", "--info", "c=2",
             "--config-name=other", "-i", "defaults", "d=-1"]
    assert hydra_flags_first(words) == ["--config-dir", "conf", "-m", "--cfg", "job", "--info", "--config-name=other",
                                        "-i", "defaults", "a=1", "+experiment=x", "~b", "c=2", "d=-1"]


WIDE_MODEL = """import torch
from torch import nn

SEEN = []  # the batch sizes the forward was called with


class Wide(nn.Module):
    def __init__(self, hidden: int = 1000):
        super().__init__()
        self.layers = nn.Sequential(nn.Flatten(), nn.Linear(256, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                    nn.Linear(hidden, 10))

    def forward(self, x):
        SEEN.append(x.shape[0])
        return self.layers(x)
"""


@pytest.mark.parametrize("hidden, batch_seen", [(2000, 2), (16, 128)])
def test_the_check_before_start_runs_a_real_forward_of_the_configured_batch_only_where_that_is_cheap(
        tmp_path, monkeypatch, hidden, batch_seen):
    """The launcher's one-batch check runs a model under 20M parameters for real on the CPU: a CIFAR ResNet-18
    (11M) on its 128 images took ~1 s of CPU at every launch (and of the docs' dry runs, 6 s of 25). A model whose
    parameters x batch is large now runs on 2 samples; a small one still on the configured batch."""
    (tmp_path / "wide_model.py").write_text(WIDE_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    import wide_model

    wide_model.SEEN.clear()
    validate(typed("~model", "+model._target_=wide_model.Wide", f"+model.hidden={hidden}", "data.batch_size=128"),
             tmp_path, cuda_devices=0)
    assert wide_model.SEEN == [batch_seen]
