"""MOPD: a (domain x effort) matrix of teachers distilled on-policy into one student (docs/mopd.md).

    effort.py    effort tokens, thinking budgets, the prompt format
    domains.py   arith / pyfunc / text: problems, reasoning traces, automatic checks
    sft.py       SFT on (prompt, completion) ids, loss on the completion
    loop.py      StepLoop: a post-training stage on the one training loop (k3.train.loop)
    rollout.py   batched graph-free sampling under a thinking budget, with log-probs
    mopd.py      reverse-KL losses, the teacher matrix, the MOPD / off-policy runs
    evaluate.py  the 9-cell table, reasoning lengths per effort, gap plots
    cli.py       `k3 distill teachers | mopd | eval | plot | generate`
"""
