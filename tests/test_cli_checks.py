"""Flags from config fields (k3.cli_checks.flag / add_flags / from_args): one name, default and help per setting,
and a config's error naming the flag the user typed."""
import argparse
from dataclasses import dataclass

import pytest

from k3.cli_checks import FieldError, add_flags, flag, flag_name, from_args


@dataclass
class Cfg:
    groups_per_step: int = flag(4, "tasks per step", name="--groups")
    eps_low: float = flag(0.2)
    agg: str = flag("token", choices=("token", "sequence"))
    scale_rewards: bool = flag(True, "no std", name="--no-std")
    verbose: bool = flag(False, "say more")
    max_turns: int | None = flag(None, "turns (default: the task's)")
    warmup_steps: int = flag(0, "warmup (default %(default)s)", aliases=("--warmup",))
    temperature: float = flag(1.0)
    top_p: float = 1.0  # not a flag

    def validate(self):
        if self.groups_per_step < 1:
            raise FieldError("groups_per_step", f"{self.groups_per_step} must be a positive integer")
        if not 0 < self.eps_low < 1:
            raise FieldError("eps_low", f"{self.eps_low} must be in (0, 1)")
        if self.warmup_steps < 0:
            raise FieldError("warmup_steps", f"{self.warmup_steps} must be >= 0")
        if self.agg == "sequence" and self.temperature != 1.0:
            raise FieldError("agg", f"sequence with temperature = {self.temperature}: use temperature = 1 or agg = "
                             "token (not_agg = x stays)", also=("temperature",))
        if self.top_p != 1.0:
            raise ValueError("top_p is not a flag")
        return self


def _parser(**kw):
    p = argparse.ArgumentParser()
    add_flags(p, Cfg, **kw)
    return p


def test_flags_take_name_type_default_and_help_from_the_fields():
    p = _parser()
    by_flag = {a.option_strings[0]: a for a in p._actions if a.option_strings and a.dest != "help"}
    assert sorted(by_flag) == ["--agg", "--eps-low", "--groups", "--max-turns", "--no-std", "--temperature",
                               "--verbose", "--warmup-steps"]
    assert by_flag["--groups"].dest == "groups_per_step" and by_flag["--groups"].type is int
    assert by_flag["--groups"].help == "tasks per step" and by_flag["--groups"].default == 4
    assert by_flag["--eps-low"].type is float and by_flag["--eps-low"].help is None
    assert by_flag["--agg"].choices == ("token", "sequence") and by_flag["--agg"].type is None
    assert by_flag["--max-turns"].type is int and by_flag["--max-turns"].default is None
    assert flag_name(Cfg, "groups_per_step") == "--groups" and flag_name(Cfg, "eps_low") == "--eps-low"
    a = p.parse_args([])
    assert (a.scale_rewards, a.verbose) == (True, False)
    a = p.parse_args(["--no-std", "--verbose", "--groups", "2", "--max-turns", "3", "--agg", "sequence"])
    assert (a.scale_rewards, a.verbose, a.groups_per_step, a.max_turns, a.agg) == (False, True, 2, 3, "sequence")
    assert from_args(Cfg, a) == Cfg(groups_per_step=2, scale_rewards=False, verbose=True, max_turns=3, agg="sequence")


def test_defaults_only_and_skip_pick_a_commands_flags():
    p = _parser(only=("groups_per_step", "eps_low"), skip=("eps_low",), defaults={"groups_per_step": 8})
    p.add_argument("--temperature", type=float, default=0.5)  # the command's own flag, not Cfg's
    a = p.parse_args([])
    assert {k: v for k, v in vars(a).items() if not k.startswith("_")} == {"groups_per_step": 8, "temperature": 0.5}
    # only the fields the command took as Cfg's flags are read; `defaults` sets the others, `over` any
    assert from_args(Cfg, a) == Cfg(groups_per_step=8)
    assert from_args(Cfg, a, defaults={"eps_low": 0.3, "verbose": True, "nope": 1}, verbose=False) == \
        Cfg(groups_per_step=8, eps_low=0.3)
    # a namespace made by hand gives every flag field it has
    assert from_args(Cfg, argparse.Namespace(groups_per_step=3, temperature=0.5, agg="token")) == \
        Cfg(groups_per_step=3, temperature=0.5)
    assert from_args(Cfg, a, only=("groups_per_step",)).groups_per_step == 8


def test_a_field_error_names_the_field_in_python_and_the_flag_on_the_command_line():
    with pytest.raises(ValueError, match=r"^groups_per_step = 0 must be a positive integer$"):
        Cfg(groups_per_step=0).validate()
    p = _parser()
    with pytest.raises(ValueError, match=r"^--groups 0 must be a positive integer$"):
        from_args(Cfg, p.parse_args(["--groups", "0"]))
    with pytest.raises(ValueError, match=r"^--eps-low 1.5 must be in \(0, 1\)$"):
        from_args(Cfg, p.parse_args(["--eps-low", "1.5"]))
    with pytest.raises(ValueError, match="^top_p is not a flag$"):  # other errors pass unchanged
        from_args(Cfg, p.parse_args([]), top_p=0.5)
    with pytest.raises(ValueError, match=r"^groups_per_step = 0 must be"):  # a value the command computed
        from_args(Cfg, p.parse_args([]), groups_per_step=0)


def test_an_alias_is_taken_and_the_error_names_the_spelling_typed():
    p = _parser()
    assert p.parse_args(["--warmup", "3"]).warmup_steps == 3 == p.parse_args(["--warmup-steps", "3"]).warmup_steps
    with pytest.raises(ValueError, match=r"^--warmup -1 must be >= 0$"):
        from_args(Cfg, p.parse_args(["--warmup", "-1"]))
    with pytest.raises(ValueError, match=r"^--warmup-steps -1 must be >= 0$"):
        from_args(Cfg, p.parse_args(["--warmup-steps", "-1"]))
    with pytest.raises(ValueError, match=r"^--warmup-steps -1 must be >= 0$"):  # a fresh parse forgets the last
        from_args(Cfg, p.parse_args(["--warmup", "2", "--warmup-steps", "-1"]))


def test_the_other_settings_an_error_names_are_named_by_their_flags_too():
    with pytest.raises(ValueError, match=r"^agg = sequence with temperature = 0.5: use temperature = 1 or agg = token "
                                         r"\(not_agg = x stays\)$"):
        Cfg(agg="sequence", temperature=0.5).validate()
    p = _parser()
    with pytest.raises(ValueError, match=r"^--agg sequence with --temperature 0.5: use --temperature 1 or --agg token "
                                         r"\(not_agg = x stays\)$"):
        from_args(Cfg, p.parse_args(["--agg", "sequence", "--temperature", "0.5"]))
    p = _parser(skip=("temperature",))  # a setting the command has no flag for keeps its field's name
    with pytest.raises(ValueError, match=r"^--agg sequence with temperature = 0.5: use temperature = 1 or --agg token"):
        from_args(Cfg, p.parse_args(["--agg", "sequence"]), defaults={"temperature": 0.5})
