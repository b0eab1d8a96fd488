"""AgentENV: tasks, a bubblewrap sandbox, physical verifiers, harness dialects, policies, rollouts.

    from k3.agentenv import load_tasks, run_episode, make_policy
    task = load_tasks("pyfix-median")[0]
    record = run_episode(task, make_policy({"kind": "reference"}, task), seed=0)
    record["reward"]   # 1.0: verified by hidden checks in a fresh sandbox

See docs/agentenv.md for the threat model and the task format.
"""
from .actions import Action, ActionError
from .dialects import DIALECTS, ParseError, choose_variant, make_dialect, make_variant
from .policies import (CallablePolicy, EpisodeInfo, OpenAIChatPolicy, Policy, PolicyError, ScriptedPolicy,
                       TextPolicy, make_policy)
from .rollout import EpisodeConfig, format_summary, run_episode, run_rollouts, summarize
from .sandbox import (Limits, SandboxConfig, SandboxError, SandboxUnavailable, Session, check_sandbox,
                      default_config)
from .tasks import FAMILIES, Task, load_task, load_tasks, tasks_root
from .verify import VerifyResult

__all__ = [
    "Action", "ActionError", "DIALECTS", "ParseError", "choose_variant", "make_dialect", "make_variant",
    "CallablePolicy", "EpisodeInfo", "OpenAIChatPolicy", "Policy", "PolicyError", "ScriptedPolicy",
    "TextPolicy", "make_policy", "EpisodeConfig", "format_summary", "run_episode", "run_rollouts",
    "summarize", "Limits", "SandboxConfig", "SandboxError", "SandboxUnavailable", "Session",
    "check_sandbox", "default_config", "FAMILIES", "Task", "load_task", "load_tasks", "tasks_root",
    "VerifyResult",
]
