"""Which harness an episode sees: swapped per episode, one fixed harness, or names never seen in training.

- `swap`: the episode seed picks one of the four AgentENV dialects and, with AgentENV's augmentation,
  renames and shuffles tools and arguments from its alias pools (`k3.agentenv.dialects.choose_variant`).
- `canonical`: the four dialects swapped per episode, each with its canonical names (no renaming).
- `fixed`: one dialect with its canonical names, every episode (`--fixed-dialect`, default react).
- `unseen`: the four call formats with tool and argument names drawn from pools that no training
  harness uses (`UNSEEN_TOOLS`, `UNSEEN_ARGS`, disjoint from every canonical name and alias; a test
  checks it). Success here needs the policy to read what each tool does from the system prompt, which
  is the tool-intent claim of training across swapped harnesses.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from k3.agentenv.dialects import CANONICAL, DIALECTS, Variant, choose_variant, make_variant
from k3.agentenv.rollout import EpisodeConfig

UNSEEN_TOOLS = {
    "read": ["inspect_file", "load_text", "peek_file"],
    "write": ["store_file", "emit_file", "persist_file"],
    "edit": ["amend_file", "rewrite_span", "splice_text"],
    "run": ["invoke_shell", "launch_process", "os_command"],
    "search": ["scan_text", "locate_text", "hunt"],
    "finish": ["conclude", "wrap_up", "sign_off"],
    "patch": ["patch_files", "change_set", "diff_apply"],
}
UNSEEN_ARGS = {
    "path": ["location", "target_file", "where"],
    "offset": ["first_row", "skip_to"],
    "limit": ["row_count", "at_most"],
    "content": ["payload", "data_text", "full_text"],
    "old": ["was", "original"],
    "new": ["becomes", "updated"],
    "replace_all": ["each_one", "everywhere"],
    "command": ["shell_input", "line", "invocation"],
    "timeout": ["budget_s", "time_cap"],
    "pattern": ["needle", "regexp"],
    "glob": ["name_mask", "files_like"],
    "summary": ["recap", "outcome"],
    "input": ["patch_body", "edits"],
}
HARNESSES = ("swap", "canonical", "fixed", "unseen")


def _camel(name: str) -> str:
    return "".join(p[:1].upper() + p[1:] for p in name.split("_"))


def unseen_variant(seed: int) -> Variant:
    """The episode's dialect (one of the four formats) with every tool and argument renamed from the unseen
    pools, in shuffled order; a pure function of the seed."""
    rng = random.Random(f"k3-rl-unseen-{seed}")
    dialect = rng.choice(DIALECTS)
    tools = {}
    for tool, (_, args) in CANONICAL[dialect].items():
        name = rng.choice(UNSEEN_TOOLS[tool])
        tools[tool] = (_camel(name) if dialect in ("kimi", "claude") else name,
                       {arg: rng.choice(UNSEEN_ARGS[arg]) for arg in args})
    order = list(CANONICAL[dialect])
    rng.shuffle(order)
    return Variant(dialect, tools, tuple(order), augmented=True)


@dataclass(frozen=True)
class FixedVariant:
    """seed -> the canonical variant of one dialect (picklable, unlike a lambda)."""

    dialect: str

    def __call__(self, seed: int) -> Variant:
        return make_variant(self.dialect)


def episode_config(harness: str, fixed_dialect: str = "react", **kw) -> EpisodeConfig:
    """The EpisodeConfig of a harness setting (`kw`: other EpisodeConfig fields, e.g. sandbox)."""
    if harness == "swap":
        return EpisodeConfig(dialects=DIALECTS, augment=True, **kw)
    if harness == "canonical":
        return EpisodeConfig(dialects=DIALECTS, augment=False, **kw)
    if harness == "fixed":
        if fixed_dialect not in DIALECTS:
            raise ValueError(f"unknown fixed dialect {fixed_dialect!r}; choose from {', '.join(DIALECTS)}")
        return EpisodeConfig(dialects=(fixed_dialect,), augment=False, variant_fn=FixedVariant(fixed_dialect), **kw)
    if harness == "unseen":
        return EpisodeConfig(variant_fn=unseen_variant, **kw)
    raise ValueError(f"unknown harness {harness!r}; choose from {', '.join(HARNESSES)}")


def variant_of(config: EpisodeConfig, seed: int) -> Variant:
    """The variant an episode with this config and seed gets (as run_episode picks it)."""
    return config.variant_fn(seed) if config.variant_fn else choose_variant(seed, config.dialects, config.augment)
