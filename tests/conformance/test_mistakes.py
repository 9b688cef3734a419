"""The catalogue of a new user's mistakes (issue 47): one row per mistake, one command each, and what the launcher
must do with it: refuse it before any process starts (exit 2, no backend asked to start, no traceback, nothing left
where the launch made a directory), with a message that names the key and says what to do. A regression in any
message or any check shows as its row.

The rows run in one process (tests/conformance/commands.py runs the command line in-process, row after row, with
every backend's start replaced by a recorder), inside a small project of the user's own: their model, data sets and
experiment files, and a directory of their own files. A row is the command's words and the phrases its error must
hold; a new mistake is a new row.
"""

from __future__ import annotations

import pytest
from conftest import FAST, run_commands
from user_project import FILES as USER_FILES
from user_project import write_project

# The user's project: a model with an annotated argument, models whose output has the wrong shape, data sets that are
# empty or wrong in one way each, an experiment of their own, and a directory of their own files.
SHAPES = '''
from torch import nn


class OnePerSample(nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.layer = nn.Linear(256, width)
        self.out = nn.Linear(width, 1)

    def forward(self, x):
        return self.out(self.layer(x.flatten(1))).squeeze(1)


class ExtraDimension(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(256, 20)

    def forward(self, x):
        return self.layer(x.flatten(1)).view(-1, 10, 2)
'''
# An evaluation set that is a stream: every rank's iteration yields the samples it gives that rank.
STREAM = '''
import torch
from torch.utils.data import IterableDataset


class VectorStream(IterableDataset):
    def __len__(self):
        return 16

    def __iter__(self):
        for i in range(16):
            yield torch.full((8,), float(i)), torch.tensor(i % 3)
'''

FILES = {
    **USER_FILES,
    "shapes.py": SHAPES,
    "stream_data.py": STREAM,
    "conf/data/empty.yaml": "# @package data\ntrain: {_target_: vectors.Empty}\neval: {_target_: vectors.Vectors, n: 10}\n",
    "conf/experiment/mine.yaml": "# @package _global_\nname: mine\n",
    "my_results/config.yaml": "my: own results\n",
    "my_results/metrics.jsonl": '{"mine": 1}\n',
    "a-file": "not a directory\n",
    "conf_own/config.yaml": "name: my_own_primary\n",
    "conf/experiment/own_train_only.yaml": "# @package _global_\ndata:\n  train: {_target_: vectors.Vectors, n: 10}\n",
    "conf/experiment/tabbed.yaml": "# @package _global_\ntrainer:\n\tmax_steps: 3\n",
    "conf/experiment/misaligned.yaml": "# @package _global_\ntrainer:\n  max_steps: 3\n   epochs: 2\n",
}
VECTOR_RUN = ["--config-dir", "conf", "+experiment=vectors"]
REPLICAS = ["trainer.procs_per_node=2", "data.batch_size=16", "trainer.fault_tolerance=replicas"]

# (id, the command's words after `python -m launcher`, phrases its error must hold; "!phrase": must not hold). Each row
# runs with FAST before its words (so Hydra's options among them come after overrides, as users write them) and,
# unless it names one, a run directory of its own under runs/.
MISTAKES = [
    # --- keys and values that are not the config's --------------------------------------------------------------
    ("misspelt-key", ["trainer.stop_check_evry=5"],
     ["trainer.stop_check_evry: trainer has no key 'stop_check_evry' (did you mean trainer.stop_check_s?); its keys "
      "are: nodes, min_nodes, gpus,", "!To append to your config"]),
    ("misspelt-model-argument", ["model.widht=5"],
     ["model.widht: model has no key 'widht' (did you mean model.width?); its keys are: _target_, channels, "
      "image_size, num_classes, width, dropout. If it is an argument your code takes", "!To append to your config"]),
    ("misspelt-key-added-with-plus", ["+trainer.max_step=5"], ["trainer.max_step", "trainer.max_steps"]),
    ("unknown-top-level-key", ["optimizer.lr=0.1"], ["optimizer"]),
    ("int-key-given-a-word", ["trainer.max_steps=many"],
     ["trainer.max_steps='many' is not an integer: give an integer (its default: trainer.max_steps=-1)."]),
    ("bool-key-given-a-word", ["trainer.compile=maybe"],
     ["trainer.compile='maybe' is not true or false: give true or false (its default: trainer.compile=false)."]),
    ("float-key-given-a-word", ["optim.lr=fast"], ["optim.lr='fast' is not a number: give a number"]),
    ("unknown-experiment", ["+experiment=imagenet"],
     ["no experiment 'imagenet' in the launcher's config", "The launcher's own: digits, gpt2_124m",
      "put it in CONF/experiment/imagenet.yaml of your project and add --config-dir CONF"]),
    ("experiment-without-plus", ["experiment=resnet18"], ["experiment", "+experiment=resnet18"]),
    ("data-train-merged-into-the-default-data", ["--config-dir", "conf", "+experiment=own_train_only"],
     ["data.train.split: vectors.Vectors has no argument 'split'",
      "data.train.split, data.train.image_size, data.train.eval_fraction, data.train.split_seed: set by data=digits",
      "choose it: data=NAME on the command line, or `defaults: [{override /data: NAME}]` in your experiment"]),
    ("two-experiments", ["+experiment=resnet18", "+experiment=gpt_tiny"],
     ["+experiment= is given more than once: a run takes one experiment",
      "write your own experiment file that starts from one (its defaults: - /experiment/NAME)",
      "!override experiment: gpt_tiny"]),
    ("own-experiment-without-config-dir", ["+experiment=mine"],
     ["conf/experiment/mine.yaml is here: add --config-dir conf so that Hydra looks there too"]),
    ("unknown-model-group", ["model=transformer"], ["no model 'transformer' in the launcher's config", "resnet18"]),
    ("unknown-launcher", ["launcher=kubernetes"], ["kubernetes", "local", "slurm", "ray"]),
    ("unknown-logger", ["+logger=neptune"], ["neptune", "wandb", "mlflow"]),
    ("tp-plan-without-plus", ["trainer.tp_plan={blocks.*.fc1:colwise}"],
     ["write '+trainer.tp_plan={blocks.*.fc1: ...}' (quoted for the shell)"]),
    # --- values the shell or Hydra's grammar take apart ------------------------------------------------------------
    ("equals-sign-in-run-dir", ["hydra.run.dir=runs/a=b"],
     ["hydra.run.dir: its value 'runs/a=b' holds '=', which Hydra's override grammar reads only inside quotes of its "
      "own: write it as 'hydra.run.dir=\"runs/a=b\"'", "!LexerNoViableAltException", "!mismatched input"]),
    ("semicolon-in-a-value", ["name=a;b"], ["name: its value 'a;b' holds ';'"]),
    ("newline-in-a-value", ["name=first\nsecond"], ["holds '\\n'", "!LexerNoViableAltException"]),
    ("dollar-parens-in-a-value", ["name=$(whoami)"], ["name: its value '$(whoami)'"]),
    # --- numbers out of range ------------------------------------------------------------------------------------
    ("zero-steps", ["trainer.max_steps=0"], ["trainer.max_steps=0", "-1 (the default) to train all trainer.epochs"]),
    ("negative-steps", ["trainer.max_steps=-5"], ["trainer.max_steps=-5"]),
    ("zero-epochs", ["trainer.epochs=0"], ["trainer.epochs=0"]),
    ("nan-lr", ["optim.lr=nan"], ["optim.lr=nan must be a finite number, 0 or more"]),
    ("negative-lr", ["optim.lr=-0.1"], ["optim.lr=-0.1"]),
    ("zero-batch", ["data.batch_size=0"], ["data.batch_size=0"]),
    ("zero-processes", ["trainer.procs_per_node=0"], ["trainer.procs_per_node=0"]),
    ("zero-nodes", ["trainer.nodes=0"], ["trainer.nodes=0"]),
    ("zero-accumulation", ["trainer.accumulate=0"], ["trainer.accumulate=0"]),
    ("negative-workers", ["data.num_workers=-1"], ["data.num_workers=-1"]),
    ("negative-restarts", ["launcher.max_restarts=-1"], ["launcher.max_restarts=-1"]),
    ("zero-keep-last", ["checkpoint.keep_last=0"], ["checkpoint.keep_last=0"]),
    ("profile-range-backwards", ["trainer.profile=[5,2]"], ["trainer.profile=[5, 2]"]),
    # --- choices that are not one of the choices ---------------------------------------------------------------------
    ("unknown-strategy", ["trainer.strategy=zero3"], ["trainer.strategy", "zero3", "ddp", "fsdp"]),
    ("unknown-precision", ["trainer.precision=fp8"], ["trainer.precision", "fp8"]),
    ("unknown-fault-tolerance", ["trainer.fault_tolerance=replica"], ["trainer.fault_tolerance", "replicas"]),
    ("unknown-nonfinite-policy", ["trainer.nonfinite=ignore"], ["trainer.nonfinite", "ignore"]),
    ("unknown-checkpoint-format", ["checkpoint.format=safetensors"], ["checkpoint.format", "safetensors"]),
    # --- the machine and the world size ------------------------------------------------------------------------
    ("more-gpus-than-present", ["trainer.gpus=4"],
     ["the config has 1 problem(s)", "trainer.gpus=4, but this machine has 0 CUDA device(s)",
      "use trainer.gpus=0 to train on CPU"]),
    ("nccl-without-cuda", ["trainer.backend=nccl"], ["trainer.backend=nccl"]),
    ("fp16-on-cpu", ["trainer.precision=fp16"], ["trainer.precision=fp16"]),
    ("several-nodes-without-endpoint", ["trainer.nodes=2"], ["launcher.rdzv_endpoint"]),
    ("tensor-parallel-larger-than-the-world", ["trainer.strategy=fsdp", "trainer.tp=4"], ["trainer.tp=4"]),
    ("tensor-parallel-under-ddp", ["trainer.tp=2", "trainer.procs_per_node=2"], ["trainer.tp=2"]),
    # --- the run directory -----------------------------------------------------------------------------------------
    ("run-dir-over-the-users-files", ["hydra.run.dir=my_results"], ["my_results", "config.yaml"]),
    ("run-dir-under-a-file", ["hydra.run.dir=a-file/run"], ["hydra.run.dir=", "a-file/run is not a writable directory"]),
    # --- the data ------------------------------------------------------------------------------------------------
    ("missing-data-set", ["+experiment=resnet18", "data.root=nothing-here"],
     ["nothing-here/cifar-10-batches-py", "cifar-10-python.tar.gz"]),
    ("empty-training-set", ["--config-dir", "conf", "data=empty"],
     ["data.train (vectors.Empty) is empty: its __len__ is 0, so there is nothing to train on",
      "!lower data.batch_size"]),
    ("empty-evaluation-set", [*VECTOR_RUN, "data.eval.n=0"], ["data.eval (vectors.Vectors) holds no sample"]),
    ("max-eval-samples-of-a-stream", [*VECTOR_RUN, "~data.eval.n", "data.eval._target_=stream_data.VectorStream",
                                      "data.max_eval_samples=8"],
     ["data.max_eval_samples=8: data.eval (VectorStream) is a stream (an IterableDataset)",
      "Make the stream yield fewer samples itself, or set data.max_eval_samples=0."]),
    ("batch-larger-than-a-share", [*VECTOR_RUN, "data.batch_size=40"],
     ["data.batch_size=40 x trainer.accumulate=1 is larger than one replica's share of the training set (32 of 64 "
      "samples on 2 replicas)"]),
    ("label-the-model-cannot-score", [*VECTOR_RUN, "+data.train.offset=1"],
     ["data.train (vectors.Vectors) has label 3, but model._target_=torch.nn.Linear scores 3 classes (labels 0..2)"]),
    ("samples-of-different-shapes", [*VECTOR_RUN, "+data.train.ragged=true"],
     ["data.train (vectors.Vectors): its samples have different shapes", "data.collate_fn is not set"]),
    ("data-file-missing", [*VECTOR_RUN, "+data.train.path=/nowhere/features.npy"],
     ["data.train (vectors.Vectors) cannot be built: FileNotFoundError",
      "data.train.path='/nowhere/features.npy' names it: give the path of a file that is there"]),
    ("inputs-of-another-dtype", [*VECTOR_RUN, "+data.train.dtype=float64"],
     ["The batch's dtypes do not fit what the model computes with: convert the inputs"]),
    ("dict-batch-without-the-target-key", [*VECTOR_RUN, "+data.train.as_dict=true"],
     ["looks for the targets of a dict batch under task.target_key='target' (or 'labels')",
      "the batch has ['features', 'label']"]),
    # --- the model -----------------------------------------------------------------------------------------------
    ("one-score-per-sample", ["~model", "+model._target_=shapes.OnePerSample"],
     ["returns scores of shape [64] for labels of shape [64]: task=classification needs one score per class and "
      "sample, [64, C]", "!.float()"]),
    ("an-extra-output-dimension", ["~model", "+model._target_=shapes.ExtraDimension"],
     ["returns scores of shape [64, 10, 2] for labels of shape [64]", "Its extra dimensions ([10]) are not the labels'",
      "!scores 2 classes"]),
    ("a-word-for-an-int-argument", ["~model", "+model._target_=shapes.OnePerSample", "+model.width=wide"],
     ["model.width='wide': shapes.OnePerSample takes width: int (default 8), not a str: give an int."]),
    ("a-word-for-the-builtin-models-int", ["model.width=wide"], ["train.models.vision.cnn takes width: int (default 32)"]),
    ("a-model-that-does-not-exist", ["~model", "+model._target_=shapes.Nothing"], ["model._target_", "shapes.Nothing"]),
    ("a-module-that-does-not-exist", ["~model", "+model._target_=nomodule.Net"], ["model._target_", "nomodule"]),
    ("an-argument-the-model-does-not-take", ["+model.depth=3"], ["model.depth", "depth"]),
    ("init-from-a-file-that-is-not-there", ["checkpoint.init_from=missing.pt"], ["checkpoint.init_from", "missing.pt"]),
    ("init-from-a-file-that-is-not-a-checkpoint", ["checkpoint.init_from=a-file"], ["checkpoint.init_from", "a-file"]),
    # --- the optimizer -------------------------------------------------------------------------------------------
    ("optimizer-called-too-early", ["~optim.optimizer._partial_"],
     ["optim.optimizer._target_=torch.optim.SGD is called by the trainer later", "add `_partial_: true`"]),
    ("collate-called-too-early", ["+data.collate_fn={_target_: torch.utils.data.default_collate}"],
     ["data.collate_fn._target_=torch.utils.data.default_collate is called by the trainer later"]),
    # --- a script of the user's own (program=script) -------------------------------------------------------------
    ("script-not-given", ["program=script"], ["program.script"]),
    ("script-that-is-not-there", ["program=script", "program.script=my_loop.py"], ["program.script", "my_loop.py"]),
    ("script-and-module-both", ["program=script", "program.script=shapes.py", "program.module=shapes"],
     ["program.script=shapes.py and program.module=shapes are both given", "keep one of them"]),
    ("script-module-that-is-not-there", ["program=script", "program.module=nomodule.loop"],
     ["program.module", "nomodule"]),
    ("script-args-as-one-word", ["program=script", "program.script=shapes.py", "program.args=--epochs 3"],
     ["program.args='--epochs 3' is not a list: give one in brackets", "'program.args=[--epochs,3]'"]),
    ("script-arg-holding-an-equals-sign", ["program=script", "program.script=shapes.py", "program.args=[--lr=0.1,--n,3]"],
     ["program.args: its value '[--lr=0.1,--n,3]' holds '='", "quote each such item of the list",
      "'program.args=[\"--lr=0.1\",--n,3]'"]),
    ("script-value-outside-program-vars", ["program=script", "program.script=shapes.py", "+T=2",
                                           "program.args=[--t,${T}]"],
     ["T is not a config key: a value of your script's own that program.args takes goes under program.vars",
      "-m +program.vars.T=2,4"]),
    # --- the backends ------------------------------------------------------------------------------------------
    ("endpoint-without-a-port", ["trainer.nodes=2", "launcher.rdzv_endpoint=node0"], ["launcher.rdzv_endpoint"]),
    ("endpoint-that-does-not-resolve", ["trainer.nodes=2", "launcher.rdzv_endpoint=no-such-host.invalid:29400"],
     ["launcher.rdzv_endpoint", "no-such-host.invalid"]),
    ("negative-hang-timeout", ["trainer.hang_timeout_s=-5"], ["trainer.hang_timeout_s=-5", "0 disables"]),
    ("slurm-time-limit-of-zero", ["launcher=slurm", "launcher.time_min=0"], ["launcher.time_min=0"]),
    ("ray-address-that-is-not-a-url", ["launcher=ray", "launcher.address=nowhere"], ["launcher.address"]),
    ("replica-groups-of-a-world-of-one", ["trainer.fault_tolerance=replicas", "trainer.procs_per_node=1"],
     ["trainer.replica_groups=2 must be a multiple of trainer.nodes=1", "leave trainer.fault_tolerance out"]),
    # what replica groups cannot do (tests/test_fault_tolerance.py trains them)
    ("replica-groups-under-tensor-parallel", [*REPLICAS, "trainer.strategy=fsdp", "trainer.tp=2"],
     ["trainer.fault_tolerance=replicas with trainer.strategy=fsdp trainer.tp=2"]),
    ("replica-groups-of-pipelines", [*REPLICAS, "trainer.strategy=pipeline"],
     ["trainer.fault_tolerance=replicas with trainer.strategy=pipeline"]),
    ("one-replica-group", [*REPLICAS, "trainer.replica_groups=1"],
     ["trainer.replica_groups=1: fault tolerance needs at least 2 replica groups"]),
    ("replica-groups-that-split-no-node-evenly", [*REPLICAS, "trainer.procs_per_node=3"],
     ["whose share per node divides the processes per node (3)"]),
    ("replica-groups-split-over-nodes", [*REPLICAS, "trainer.nodes=2", "trainer.replica_groups=3",
                                         "launcher.rdzv_endpoint=localhost:29400"],
     ["trainer.replica_groups=3 must be a multiple of trainer.nodes=2"]),
    ("more-replicas-required-than-groups", [*REPLICAS, "trainer.min_replicas=3"],
     ["trainer.min_replicas=3 must be between 1 and trainer.replica_groups=2"]),
    ("fault-tolerance-of-an-unknown-kind", [*REPLICAS, "trainer.fault_tolerance=groups"], ["trainer.fault_tolerance"]),
    # --- run directories and sweeps (issue 61) ---------------------------------------------------------------------
    ("run-dir-with-a-quoted-tilde", ["hydra.run.dir='~/runs/x'"],
     ["hydra.run.dir=~/runs/x: '~' is not expanded here", "a directory named '~' would be made"]),
    ("config-dir-with-its-own-primary-config", ["--config-dir", "conf_own"],
     ["--config-dir conf_own: its config.yaml would not be read", "conf_own/experiment/NAME.yaml"]),
    ("console-rank-beyond-the-node", ["launcher.console_ranks=[2]", "trainer.procs_per_node=2"],
     ["launcher.console_ranks=[2]: local ranks run from 0 to 1 on each node here"]),
    ("unknown-numa-binding", ["launcher.numa_binding=nearest"],
     ["launcher.numa_binding='nearest' is not one of none, node, socket, exclusive, core-complex"]),
    ("empty-sweep", ["-m", "data.batch_size=range(8,8)", "hydra.sweep.dir=multirun/empty"],
     ["the sweep has no points", "give each swept key at least one value"]),
    ("run-dir-with-accents", ["hydra.run.dir=runs/ëxpérience"],
     ["hydra.run.dir: its value 'runs/ëxpérience' holds 'é', 'ë'",
      "write it as 'hydra.run.dir=\"runs/ëxpérience\"'", "!write KEY=VALUE"]),
    ("run-dir-with-a-tilde", ["hydra.run.dir=~/x"],
     ["hydra.run.dir: '~' is not expanded inside an override", "hydra.run.dir=$HOME/x", "!write KEY=VALUE"]),
    ("list-split-by-a-space", ["-m", "optim.lr=0.1,", "0.2"],
     ["'optim.lr=0.1,' ends with a comma: the shell split the list at a space after it",
      "Write the values without spaces (optim.lr=0.1,...) or quote the whole override"]),
    ("experiment-indented-by-a-tab", ["--config-dir", "conf", "+experiment=tabbed"],
     ["conf/experiment/tabbed.yaml, line 3, column 1: not valid YAML",
      "YAML indents with spaces, never tabs: replace the tab with spaces"]),
    ("experiment-misaligned", ["--config-dir", "conf", "+experiment=misaligned"],
     ["conf/experiment/misaligned.yaml, line 4, column 10: not valid YAML (mapping values are not allowed here)",
      "check the indentation there"]),
    ("eval-fraction-of-the-whole-set", ["data.eval_fraction=1.0"],
     ["data.eval_fraction=1.0: the share of the samples held out", "between 0 and 1, both excluded"]),
    # --- checkpoint stores (issue 62) ------------------------------------------------------------------------------
    ("store-url-with-credentials", ["checkpoint.store=s3://AKIA:secret@bucket/run"],
     ["the URL holds credentials", "give the bucket alone (s3://bucket/prefix)"]),
    ("store-of-an-unknown-scheme", ["checkpoint.store=nosuch://bucket/run"],
     ["checkpoint.store=nosuch://bucket/run: Protocol not known", "give an fsspec URL"]),
    ("language-modeling-on-images", ["task=language_modeling"],
     ["task=language_modeling predicts a token at every position", "targets of shape [", "(one label per sample)",
      "use task=classification"]),
    # --- an elastic world (issue 63) -------------------------------------------------------------------------------
    ("elastic-more-than-the-nodes", ["trainer.nodes=2", "trainer.min_nodes=3", "launcher.rdzv_endpoint=localhost:29731",
                                     "launcher.max_restarts=1"],
     ["trainer.min_nodes=3 must be between 1 and trainer.nodes=2"]),
    ("elastic-without-restarts", ["trainer.nodes=2", "trainer.min_nodes=1", "launcher.rdzv_endpoint=localhost:29731"],
     ["trainer.min_nodes=1 needs launcher.max_restarts of 1 or more", "each loss counts as a restart"]),
    ("elastic-with-replica-groups", ["trainer.nodes=2", "trainer.min_nodes=1", "launcher.max_restarts=1",
                                     "launcher.rdzv_endpoint=localhost:29731", "trainer.fault_tolerance=replicas"],
     ["with trainer.fault_tolerance=replicas: replica groups already train on", "pick one of the two"]),
    ("elastic-on-ray-without-restarts", ["launcher=ray", "launcher.dry_run=true", "launcher.max_restarts=0", "trainer.nodes=2",
                                         "trainer.min_nodes=1"],
     ["trainer.min_nodes=1 needs launcher.max_restarts of 1 or more", "!Traceback"]),
    # --- trackers ------------------------------------------------------------------------------------------------
    ("mlflow-at-an-address-nobody-serves", ["+logger=mlflow", "loggers.mlflow.tracking_uri=http://127.0.0.9:5999"],
     ["loggers.mlflow.tracking_uri=http://127.0.0.9:5999: no MLflow server answers at 127.0.0.9:5999",
      "or log to a local store with loggers.mlflow.tracking_uri=sqlite:///"]),
]


@pytest.fixture(scope="module")
def catalogue(tmp_path_factory):
    """Every row run once in one process, in the project: {id: result}."""
    project = tmp_path_factory.mktemp("project")
    write_project(project, FILES)
    rows = []
    for name, args, _ in MISTAKES:
        run_dir = [] if any(arg.startswith("hydra.run.dir=") for arg in args) else [f"hydra.run.dir=runs/{name}"]
        rows.append({"id": name, "args": [*FAST, *args, *run_dir]})
    results = run_commands(project, rows, env={"WANDB_MODE": "offline"})
    return project, results


@pytest.mark.parametrize("name,args,phrases", MISTAKES, ids=[row[0] for row in MISTAKES])
def test_a_mistake_is_refused_before_start_with_the_key_and_the_fix(catalogue, name, args, phrases):
    project, results = catalogue
    result = results[name]
    said = result["stderr"]
    assert not result["started"], f"started: {' '.join(args)}\n{result['stdout'][-1500:]}"
    assert result["code"] == 2, f"exit {result['code']}: {said[-2000:]}"
    assert "Traceback" not in said, said[-3000:]
    missing = [phrase for phrase in phrases if not phrase.startswith("!") and phrase not in said]
    assert not missing, f"{missing} not in:\n{said}"
    wrong = [phrase[1:] for phrase in phrases if phrase.startswith("!") and phrase[1:] in said]
    assert not wrong, f"{wrong} in:\n{said}"
    assert not (project / "runs" / name).exists(), "a refused launch left its directory behind"


def test_the_users_own_files_are_as_they_were_after_every_row(catalogue):
    project, _ = catalogue
    for name, text in FILES.items():
        assert (project / name).read_text() == text, f"{name} was changed"
    assert sorted(p.name for p in (project / "my_results").iterdir()) == ["config.yaml", "metrics.jsonl"]
    assert not (project / "~").exists()  # no directory named '~' in the project (run-dir-with-a-quoted-tilde)
