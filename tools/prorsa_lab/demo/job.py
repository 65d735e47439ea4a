"""The default doubles demo's workload: a multi-task job that alternates the paper's tasks.

Multi-task RL jobs dispatch their tasks' samples in turn; each trajectory keeps its task
to the end, and its ``sample_dispatched`` event carries the task's label, so the
Controller's per-task forecast sees the mix change as the trainer dispatches it. The three
tasks are those of the paper ("Prorsa", arXiv 2610.16592, §3.1 and §5.1): the coding agent
(SWE-smith), the general agent (APEX-Agents, Toolathlon, MCP-Atlas) and math (AIME25), as
the simulator's profiles (:mod:`prorsa_lab.sim.workloads`) size them, scaled to what four
engine doubles on two shared cores serve (docs/demo.md, "Sizing: the multi-task job").

One scale holds for every task where it can, so that the tasks keep their ratios to each
other; where a figure is not the profile's scaled, it says why next to it:

* **tokens**: prompts and tool results are the profile's, contexts capped at
  ``MAX_CONTEXT`` (a fifth of a double's 40,000 KV tokens);
* **outputs**: half the profile's (``OUTPUTS``): a double decodes about 20 tokens a second
  per request (40 ms steps), so a coding turn of the profile's 480 tokens would decode for
  24 s, a third of a phase;
* **tool times**: the profile's. They set how often a trajectory sends a prompt, which is
  what the phases are about;
* **sandbox starts and rewards**: a tenth of the profile's (``IDLE_TIMES``). They ask no
  engine, and only delay the trajectory that replaces a finished one;
* **turns**: a tenth of the coding agent's 38 model calls, fewer where the context cap ends
  a trajectory first, so that a trajectory lasts less than a phase (a coding one about a
  minute of the 80 s) and the job's mix turns over within one.
"""

from __future__ import annotations

from prorsa_lab.demo.workload import DemoTask, JobTask, PhaseShape
from prorsa_lab.sim.workloads import CODING, GENERAL, MATH, LogNormal

OUTPUTS = 0.5
IDLE_TIMES = 0.1
MAX_CONTEXT = 8_000


def _scaled(d: LogNormal, factor: float) -> LogNormal:
    return LogNormal(d.median * factor, d.sigma, d.lo * factor, d.hi * factor)


# Coding agent: long contexts under KV pressure, decode-leaning. A turn decodes for about
# 11 s (240 tokens), longer than C_KV / θ_P = 4 s of a double, so it asks more decode
# instances than prefill ones; the contexts (3,500-token first prompts, ~350-token tool
# results) hold about two decode instances' KV at 24 live trajectories.
_CODING_TURN = PhaseShape(
    output=_scaled(CODING.output, OUTPUTS),  # a thought plus one command: 240 tokens
    # bash 60% (median 3.58 s, mean 5.9 s), read and edit 40% (< 0.1 s): bash's
    # distribution, read and edit in its lower tail, capped at 12 s.
    tool_seconds=LogNormal(3.58, 1.0, 0.05, 12.0),
    # bash 350, read 900, edit 60 tokens (medians): their mix's median, spread as bash's.
    result_tokens=LogNormal(350, 1.0, 10, 3000),
)
CODING_AGENT = DemoTask(
    name="coding",
    profile=CODING,
    prompt=CODING.prompt,  # 3,500 tokens: system prompt, tools, the issue
    turns_min=2,
    turns_max=4,  # mean 3: the profile's 38 model calls cut to what fits a phase
    tools=_CODING_TURN,
    reasoning=_CODING_TURN,
    startup_seconds=_scaled(CODING.prewarm, IDLE_TIMES),  # prewarmed sandbox: 1 s, a tenth
    reward_seconds=_scaled(CODING.reward, IDLE_TIMES),  # the test suite: 35 s, a tenth
    accept=CODING.accept,
    max_context=MAX_CONTEXT,
)

# General agent: many short tool calls, prefill-leaning. MCP tool schemas make the first
# prompt long (5,000 tokens) and search results and pages the tool results (400-1,800).
# The model's turn is the tool call alone, about 25 tokens (1.2 s of decode): the profile's
# 380 tokens per turn are a thought plus the call, and a turn that decodes for more than
# C_KV / θ_P = 4 s leans decode on the doubles whatever its task. This is the one figure
# set for the lean rather than scaled (docs/demo.md).
_GENERAL_TURN = PhaseShape(
    output=LogNormal(25, 0.5, 10, 100),
    tool_seconds=GENERAL.tools[0].seconds,  # search, browse, MCP, code: 1-10 s, median 3.2 s
    # search 700, browse 1,800, MCP 400, code 150 tokens (medians, weights 35/25/30/10%):
    # their mix's median.
    result_tokens=LogNormal(600, 0.8, 20, 3000),
)
GENERAL_AGENT = DemoTask(
    name="general",
    profile=GENERAL,
    prompt=LogNormal(5000, 0.25, 3000, 6500),  # the profile's median, 5,000
    turns_min=3,
    turns_max=8,  # the profile's 5-20 turns, shortened by the 8,000-token context cap
    tools=_GENERAL_TURN,
    reasoning=_GENERAL_TURN,
    startup_seconds=_scaled(GENERAL.prewarm, IDLE_TIMES),  # MCP servers, a browser: a tenth
    reward_seconds=_scaled(GENERAL.reward, IDLE_TIMES),  # rubric or LLM judge: 4 s, a tenth
    accept=GENERAL.accept,
    max_context=MAX_CONTEXT,
)

# Math: one burst of short prompts (an AIME statement, 260 tokens), then long decodes.
# The profile's answers are 7,000 tokens (4-16k) after 1-3 turns; a twentieth of them
# (350 tokens, 16 s) keeps a math trajectory within a phase. Its prompts ask almost no
# prefill; its answers hold little KV (a double reserves prompt plus answer).
_MATH_TURN = PhaseShape(
    # The profile's final answer, 7,000 tokens (2,048-16,384): a twentieth.
    output=LogNormal(7000 * OUTPUTS / 10, 0.45, 2048 * OUTPUTS / 10, 16384 * OUTPUTS / 10),
    tool_seconds=MATH.tools[0].seconds,  # the Python interpreter: 0.8 s
    result_tokens=MATH.tools[0].result_tokens,  # its output: 60 tokens
)
MATH_TASK = DemoTask(
    name="math",
    profile=MATH,
    prompt=MATH.prompt,
    turns_min=MATH.turns_min,
    turns_max=2,  # the profile's 1-3, less the longest
    tools=_MATH_TURN,
    reasoning=_MATH_TURN,
    startup_seconds=_scaled(MATH.prewarm, IDLE_TIMES),
    reward_seconds=_scaled(MATH.reward, IDLE_TIMES),  # rule-based answer check
    accept=MATH.accept,
    max_context=MAX_CONTEXT,
)

MULTI_TASK_JOB: tuple[JobTask, ...] = (
    JobTask(task=CODING_AGENT, lean="reasoning"),
    JobTask(task=GENERAL_AGENT, lean="tools"),
    JobTask(task=MATH_TASK, lean="reasoning"),
)
"""Coding, general agent, math: one phase each (80 s in the default 240 s run). Coding
first: the switching run starts at 1P:3D (``roles.prefill.initial: 1``), the coding
agent's split, so the first phase asks for no move, and the split must go both ways after."""
