"""The four-walls planner: memory, bandwidth, communication and latency of a K3 configuration on a parallel
layout and a GPU, with what-ifs that switch off one K3 choice at a time (docs/planner.md)."""
from k3.plan.hardware import Hardware, load_hardware, preset_names
from k3.plan.walls import Layout, Options, check_layout, min_gpus_to_serve, plan
from k3.plan.whatif import WHAT_IFS, apply_what_if, headline, what_ifs

__all__ = ["Hardware", "Layout", "Options", "WHAT_IFS", "apply_what_if", "check_layout", "headline",
           "load_hardware", "min_gpus_to_serve", "plan", "preset_names", "what_ifs"]
