"""Fuzzing what users type: model configs and `hpc-tp train` flags. Every input either works or
raises the project's one-line ConfigError (or argparse's usage error); nothing else escapes."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpc_tp.cli import build_parser
from hpc_tp.comm.mpi import self_comm
from hpc_tp.errors import ConfigError
from hpc_tp.models.config import ModelConfig
from hpc_tp.train.command import settings_from_args
from hpc_tp.train.trainer import Trainer

FIELDS = list(ModelConfig.__dataclass_fields__) + ["not_a_field"]
values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 300),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["", "rmsnorm", "layernorm", "rope", "learned", "swiglu", "gelu", "bert", "x"]),
    st.lists(st.integers(0, 4), max_size=2),
    st.dictionaries(st.sampled_from(["rope_type", "factor"]), st.integers(0, 8), max_size=2),
)
quick = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _one_line(error: ConfigError):
    assert str(error) and "\n" not in str(error), repr(error)


@quick
@given(st.dictionaries(st.sampled_from(FIELDS), values, max_size=6))
def test_model_configs_are_valid_or_a_clear_error(changes):
    base = dict(vocab_size=50, hidden=16, n_layers=1, n_heads=2, max_seq_len=16)
    try:
        ModelConfig.from_dict({**base, **changes}).validate()
    except ConfigError as e:
        _one_line(e)


FLAG_VALUES = {
    "--tp": st.integers(-1, 5),
    "--pp": st.integers(-1, 3),
    "--dp": st.integers(-1, 3),
    "--micro-batch": st.integers(-1, 9),
    "--global-batch": st.integers(-1, 17),
    "--seq-len": st.integers(-1, 80),
    "--steps": st.integers(-1, 3),
    "--lr": st.floats(-1, 1),
    "--warmup": st.integers(-1, 4),
    "--weight-decay": st.floats(-1, 1),
    "--clip-grad": st.floats(-1, 2),
    "--dtype": st.sampled_from(["float32", "float64", "float16", "int8"]),
    "--schedule": st.sampled_from(["1f1b", "gpipe", "zigzag"]),
    "--data": st.sampled_from(["demo", "missing.txt", "."]),
    "--pp-layers": st.sampled_from(["1,1", "2", "0,2", "x"]),
    "--set": st.sampled_from(["dropout=0.1", "hidden=17", "n_heads=0", "norm=bogus", "dropout", "=1", "num_experts=2"]),
    "--eval-problems": st.integers(-1, 3),
    "--samples": st.integers(-1, 2),
    "--keep": st.integers(-2, 2),
}


@quick
@given(
    st.dictionaries(st.sampled_from(sorted(FLAG_VALUES)), st.none(), max_size=5).flatmap(
        lambda chosen: st.fixed_dictionaries({flag: FLAG_VALUES[flag] for flag in chosen})
    )
)
def test_train_flags_work_or_fail_with_a_clear_error(tmp_path, monkeypatch, flags):
    monkeypatch.chdir(tmp_path)  # nothing a fuzzed run writes lands in the checkout
    argv = ["train", "--model", "tiny", "--no-progress"]
    for flag, value in flags.items():
        argv += [flag, str(value)]
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse's usage error: a type or a choice it checks itself
        assert e.code == 2
        return
    try:
        trainer = Trainer(settings_from_args(args), self_comm())
    except ConfigError as e:
        _one_line(e)
        return
    assert trainer.grid.tp_size * trainer.grid.pp_size * trainer.grid.dp_size == 1


@pytest.mark.parametrize("argv", [["train", "--tp", "x"], ["train", "--schedule", "zigzag"]])
def test_argparse_rejects_types_and_choices(argv):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2
