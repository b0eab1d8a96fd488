"""Checks the commands run on their flags before any work, each raising a ValueError that names the flag; and the
flags of config fields (`flag`, `add_flags`, `from_args`), so a setting has one name, default and help."""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path


def at_least(args: argparse.Namespace, low: int, *flags: str) -> None:
    """Each integer --flag given (not None) is >= low."""
    for flag in flags:
        v = getattr(args, flag[2:].replace("-", "_"))
        if v is not None and v < low:
            raise ValueError(f"{flag} {v} must be " + ("a positive integer" if low == 1 else f"an integer >= {low}"))


def _parents_are_dirs(flag: str, path: Path) -> None:
    """The nearest existing parent of `path` is a directory (not a file that the path would have to go under)."""
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"{flag} {path}: {parent} is a file, not a directory; give another path")
            break


def output_file(flag: str, path, example: str | None = None) -> None:
    """An output file path (None: not given) that can be written: not a directory, not under a file."""
    if path is None:
        return
    p = Path(path)
    if p.is_dir():
        hint = f" such as {p / example}" if example else ""
        raise ValueError(f"{flag} {path} is a directory; give a file path{hint}")
    _parents_are_dirs(flag, p)


PLOT_MAGIC = {".png": b"\x89PNG\r\n\x1a\n", ".svg": b"<", ".pdf": b"%PDF"}  # how each plot file starts
MATPLOTLIB_PLOTS = tuple(PLOT_MAGIC)  # where savefig takes the format from the suffix


def output_png(flag: str, path, example: str = "plot.png", suffixes: tuple[str, ...] = (".png",)) -> None:
    """A plot's path (None: not given): a writable file name with one of `suffixes` (matplotlib takes the format
    from it) that, when it exists, holds a plot of that format to replace, not a file of the user's."""
    if path is None:
        return
    output_file(flag, path, example)
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix not in suffixes:
        kinds = " or ".join(s[1:].upper() for s in suffixes)
        raise ValueError(f"{flag} {path}: the plot is written as {kinds}; give a file name ending in "
                         f"{' or '.join(suffixes)}")
    if p.is_file():
        with open(p, "rb") as f:
            head = f.read(8).lstrip() if suffix == ".svg" else f.read(8)
        if not head.startswith(PLOT_MAGIC[suffix]):
            raise ValueError(f"{flag} {path} exists and is not a {suffix[1:].upper()} plot; the plot would replace "
                             "it: give another path")


def output_jsonl(flag: str, path, example: str) -> None:
    """A JSON-lines output (None: not given) that, when it exists with content, holds JSON lines to replace, not
    another file of the user's."""
    if path is None:
        return
    output_file(flag, path, example)
    p = Path(path)
    if p.is_file() and p.stat().st_size:
        from k3.fileio import loads_json

        with open(p, "rb") as f:
            first = f.readline(1 << 20)
        if len(first) == 1 << 20 and not first.endswith(b"\n"):  # a long first record (a whole transcript)
            ok = first.startswith(b"{")
        else:
            try:
                ok = isinstance(loads_json(first), dict)  # a deep first line was a RecursionError
            except ValueError:  # JSONDecodeError and bytes that are not UTF-8
                ok = False
        if not ok:
            raise ValueError(f"{flag} {path} exists and does not hold JSON lines; the output would replace it: give "
                             "another path")


def output_dir(flag: str, path) -> None:
    """An output directory path (None: not given) that can be made or used: not a file, not under a file."""
    if path is None:
        return
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"{flag} {path} is a file; give a directory")
    _parents_are_dirs(flag, p)


MAX_SEED = 2 ** 62  # room for the offsets added to a seed (seed + step, seed + sample index) below torch's 2^64


def seed(text: str) -> int:
    """argparse type of --seed: an integer in [0, 2^62) (torch.manual_seed overflowed on larger ones, with a message
    that named no flag)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 0 <= v < MAX_SEED:
        raise argparse.ArgumentTypeError(f"{v} is outside [0, 2^62): give a seed in that range")
    return v


# ---------------------------------------------------------------------- flags from config fields
class FieldError(ValueError):
    """A config field's bad value, raised by a config's validate(). str() names the field (`group_size = 1: ...`);
    `named(flags)` is the same message naming the flag that set it (`--group-size 1: ...`), as a command reports it.
    `also`: other settings the message names, each written `name = value` in it (`kl = sampled with temperature =
    0.5`), which a command names by their flags too (`--kl sampled with --temperature 0.5`)."""

    def __init__(self, field: str, rest: str, also: tuple[str, ...] = ()):
        super().__init__(f"{field} = {rest}")
        self.field, self.rest, self.also = field, rest, tuple(also)

    def named(self, flags) -> str:
        """The message with `flags(field)` (a flag, or None where no flag sets that field) for each setting it names."""
        text = str(self)
        for field in (self.field, *self.also):
            flag = flags(field)
            if flag:
                text = _setting_as_flag(text, f"{field} = ", f"{flag} ")
        return text


def _setting_as_flag(text: str, setting: str, flag: str) -> str:
    """`setting` ("kl = ") replaced by `flag` ("--kl ") where it starts a word (not inside "reverse_kl = ")."""
    out, i = [], 0
    while (j := text.find(setting, i)) >= 0:
        starts_word = j == 0 or not (text[j - 1].isalnum() or text[j - 1] in "_-")
        out.append(text[i:j] + (flag if starts_word else setting))
        i = j + len(setting)
    return "".join(out) + text[i:]


def flag(default=dataclasses.MISSING, help: str | None = None, *, name: str | None = None, aliases: tuple = (),
         **argparse_kw):
    """A dataclass field that is also a command-line flag: `--kebab-name` (or `name`), its default the field's,
    its type the annotation's (int, float, str; `X | None` is X; a bool is a switch), `help` and any other
    argparse keyword (choices, metavar, action, type, nargs, const) as given; `aliases`: other spellings a command
    also takes (one command spelled it so), for a flag that takes a value. `add_flags` adds it, `from_args` reads it
    back."""
    meta = {"name": name, "help": help, **argparse_kw}
    if aliases:
        meta["aliases"] = tuple(aliases)
    return dataclasses.field(default=default, metadata={"flag": meta})


def _flag_fields(cls, only=None, skip=()):
    for f in dataclasses.fields(cls):
        if "flag" in f.metadata and f.name not in skip and (only is None or f.name in only):
            yield f


def flag_name(cls, field: str) -> str:
    """The flag that sets `field` of config class `cls` (its `flag(name=...)`, else --kebab-name)."""
    meta = next((f.metadata.get("flag") for f in dataclasses.fields(cls) if f.name == field), None) or {}
    return meta.get("name") or "--" + field.replace("_", "-")


def _flag_type(f):
    hint = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    base = hint.replace(" ", "").replace("|None", "").replace("None|", "")
    return {"int": int, "float": float, "str": str, "bool": bool}.get(base)


# Namespace attribute that `add_flags` fills: field -> the flag that sets it in this command (the spelling typed,
# for a flag with aliases), so `from_args` reads only the command's config flags and names the one typed.
_SET_BY = "_config_flags"


class _Spelled(argparse._StoreAction):  # a store action still (k3.cli's check of empty values reads those)
    """argparse's store, also recording which of the flag's spellings was typed."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        setattr(namespace, _SET_BY, {**getattr(namespace, _SET_BY, {}), self.dest: option_string})


def add_flags(parser, cls, only=None, skip=(), defaults: dict | None = None, helps: dict | None = None) -> None:
    """One flag per field of `cls` made with `flag()` (`only` / `skip`: field names), dest the field's name;
    `defaults` overrides a field's default for this command (entries for other fields are ignored), `helps` its
    help where the command's default changes what the help says."""
    defaults, helps = defaults or {}, helps or {}
    set_by = dict(parser.get_default(_SET_BY) or {})
    for f in _flag_fields(cls, only, skip):
        meta = f.metadata["flag"]
        kw = {k: v for k, v in meta.items() if k not in ("name", "aliases") and v is not None}
        if f.name in helps:
            kw["help"] = helps[f.name]
        default = defaults.get(f.name, f.default)
        typ = _flag_type(f)
        if typ is bool or kw.get("action") in ("store_true", "store_false"):
            kw.setdefault("action", "store_false" if default else "store_true")
        else:
            if "type" not in kw and typ is not None and typ is not str:
                kw["type"] = typ
            if "choices" not in kw:  # `--groups GROUPS`, not the dest's GROUPS_PER_STEP
                kw.setdefault("metavar", flag_name(cls, f.name).lstrip("-").replace("-", "_").upper())
            if meta.get("aliases"):
                kw["action"] = _Spelled
        parser.add_argument(flag_name(cls, f.name), *meta.get("aliases", ()), dest=f.name, default=default, **kw)
        set_by[f.name] = flag_name(cls, f.name)
    parser.set_defaults(**{_SET_BY: set_by})


def from_args(cls, args, only=None, skip=(), defaults: dict | None = None, **over):
    """cls(...) from the parsed flags that `add_flags` added (over `defaults`: values of fields the command has no
    flag for, e.g. post-training's), with `over` on top, validated; a FieldError becomes the same message naming
    the flags that set the values (a value in `over` the command computed: its field stays named). A namespace made
    by hand (no `add_flags`) gives every flag field of `cls` it has an attribute for."""
    set_by = getattr(args, _SET_BY, None)
    names = {f.name for f in _flag_fields(cls, only, skip)
             if (f.name in set_by if set_by is not None else hasattr(args, f.name))}
    values = {k: getattr(args, k) for k in names}
    fields = {f.name for f in dataclasses.fields(cls)}
    base = {k: v for k, v in (defaults or {}).items() if k in fields}
    try:
        return cls(**{**base, **values, **over}).validate()
    except FieldError as e:
        raise ValueError(e.named(lambda field: None if field not in names or field in over else
                                 (set_by or {}).get(field) or flag_name(cls, field))) from None
