"""Teams as config data: the shipped teams, and what a `TeamSection` declares: its roles in
order, each role's adapter and backbone (the agents a rollout plays are built from these by
`build.team.build_team`).

A config file declares its team in `team.roles` (one `RoleSection` per role: prompt,
description, graded flag, adapter, sampling), `team.order` and `team.graph`; the shipped
teams below are such data, which a config file copies in with `shipped(task, num_roles)`:

  arithmetic / math_jsonl, 1 role:  solver
  2 roles: reasoner → actor                 (the actor's answer is graded)
  3 roles: reasoner → actor → verifier      (the verifier restates or fixes it; graded)
  4 roles: analyst → planner → solver → verifier
  code, 2 roles: planner → coder            (the coder's program is graded)
  code, 3 roles: planner → coder → reviewer (the reviewer returns the final program)
  echo (tests), n roles: helper0 … → repeater
  split_facts, 2 roles: reporter → answerer      (the reporter sees the facts, the answerer
                                                 the question; the answerer is graded)
  verify_correct, 2 roles: solver → checker      (the checker gives the final answer)
  grid_path, 2 roles: planner → executor         (the executor writes the graded path)

The math roles have two prompt sets: one-line arithmetic ("arithmetic", tuned on level-1
problems) and multi-step word problems ("math_jsonl"; the same role names, calibrated
below `_WORD_ROLES`).

Adapters: each "own" role gets its own adapter, in `order`; every "shared" role runs one more
adapter; a "base" role runs none (the frozen model speaks for it and it is not trained); an
orchestrator gets the next adapter. `team.shared_adapter` puts every agent on adapter 0.
"""

from __future__ import annotations

import dataclasses

from marft_jax.envs.profiles import NO_ADAPTER
from marft_jax.train.config.sections import MAIN_BACKBONE, RoleSection, TeamSection

_BOXED = "Put the final answer, a number, in \\boxed{}."
_FENCE = "Write the whole program in one ```python fenced block; it reads stdin, prints stdout."
# Both short and with a worked form: SmolLM2-135M follows "answer in one line, e.g. ..." but
# ignores "step by step" requests, rambling past its token cap (untuned reasoner → actor,
# level-1 arithmetic, greedy: 2 % with "step by step", 12.5 % with these; 32 held-out
# problems; docs/results.md). The actor is short on purpose: its turn stays cheap.
_SINGLE_SOLVER = RoleSection(
    "solver", "You are good at arithmetic. Answer in one line: the calculation and the result, "
    "e.g. 7 + 5 = 12.", "Solves the problem.", graded=True)
_MATH_ROLES = {r.name: r for r in (
    RoleSection("reasoner", "You are the Reasoner of a small math team. You are good at "
                "arithmetic. Answer in one line: the calculation and the result, e.g. "
                "7 + 5 = 12.", "Writes the calculation and its result."),
    RoleSection("actor", "You are the Actor of a small math team. Reply with only the result "
                "of the Reasoner's calculation, in \\boxed{}, e.g. \\boxed{12}.",
                "States the final answer."),
    RoleSection("verifier", "You are the Verifier of a small math team. Check the work written "
                f"before you step by step. If it is right, restate the answer; if not, correct "
                f"it. {_BOXED}", "Checks the answer and gives the corrected final answer."),
    RoleSection("analyst", "You are the Analyst of a math team. Restate the problem in your own "
                "words and list every number it gives with what it means. Do not solve it.",
                "Restates the problem and lists its quantities."),
    RoleSection("planner", "You are the Planner of a math team. From the analysis before you, "
                "write a short numbered plan of calculations. Do not carry them out.",
                "Writes a numbered plan of calculations."),
    RoleSection("solver", "You are the Solver of a math team. Carry out the plan before "
                f"you step by step. {_BOXED}", "Carries out the plan and computes the answer."),
)}
_CODE_ROLES = {r.name: r for r in (
    RoleSection("planner", "You are the Planner of a programming team. Read the task, note the "
                "input and output formats and the edge cases, and write a step-by-step "
                "algorithm. Write no code.", "Writes an algorithm plan, without code."),
    RoleSection("coder", f"You are the Coder of a programming team. Implement the plan before "
                f"you in Python. {_FENCE}", "Implements the plan as a Python program."),
    RoleSection("reviewer", "You are the Reviewer of a programming team. Read the program "
                "before you, look for bugs and missed edge cases, and give the final program, "
                f"corrected if needed. {_FENCE}", "Reviews the program and gives the final "
                "version."),
)}
# Multi-step word problems (task "math_jsonl": GSM8K, MATH, MATH-500 style files). Each turn
# asks for one thing in a worked form (SmolLM2-135M copies forms more than it follows
# instructions): the quantities, one calculation per line, the final number in \boxed{}.
# Calibration, untuned reasoner → actor, greedy, the 12 bundled GSM8K-style problems
# (docs/results.md, "Math word-problem prompts: calibration"): these prompts with 128 + 32
# tokens 0/12 right, answer format 25 % (3 "the answer is", no \boxed{}), replies 120 + 28
# tokens; the arithmetic prompts with 48 + 16 tokens 0/12, format 0 %, replies 34 + 16. The
# model still opens with "To solve this problem, ..." and reaches the 128 cap on 8 of 12
# before its "Answer:" line; the actor copies the reasoner's opening. A floor to train from,
# not a tuned prompt.
_WORKED = ("e.g. 24 + 18 = 42\n42 - 30 = 12\nAnswer: \\boxed{12}")
_WORD_SOLVER = RoleSection(
    "solver", "You solve math word problems. Write one calculation per line with its result, "
    f"then the final answer in \\boxed{{}}, {_WORKED}", "Solves the problem.", graded=True)
_WORD_ROLES = {r.name: r for r in (
    RoleSection("reasoner", "You are the Reasoner of a small math team. Solve the word problem: "
                "write one calculation per line with its result, then the final answer in "
                f"\\boxed{{}}, {_WORKED}", "Writes the calculations and their results."),
    RoleSection("actor", "You are the Actor of a small math team. Reply with only the final "
                "answer of the Reasoner, in \\boxed{}, e.g. \\boxed{12}.",
                "States the final answer."),
    RoleSection("verifier", "You are the Verifier of a small math team. Check the calculations "
                "before you. Reply with only the final answer, corrected if needed, in "
                "\\boxed{}, e.g. \\boxed{12}.", "Checks the answer and gives the final answer."),
    RoleSection("analyst", "You are the Analyst of a math team. List every number in the "
                "problem with what it means, one per line, e.g. 24 = rolls baked in the "
                "morning. Do not solve it.", "Lists the problem's quantities."),
    RoleSection("planner", "You are the Planner of a math team. Write the calculations that "
                "solve the problem, one per line, e.g. rolls baked = 24 + 18. Do not compute "
                "them.", "Writes the calculations to do."),
    RoleSection("solver", "You are the Solver of a math team. Carry out the calculations "
                f"before you, one per line with its result, then the final answer in \\boxed{{}}, "
                f"{_WORKED}", "Carries out the calculations and computes the answer."),
)}
# The team tasks (envs/team_tasks.py): two roles each, the second graded. Each prompt asks for
# one thing in a worked form; calibrated for the untuned SmolLM2-135M team in
# docs/team_tasks.md (held-out accuracy between 5 and 40 %).
_TEAM_TASK_ROLES = {
    "split_facts": (
        RoleSection("reporter", "You are the Reporter of a two-person team. You see facts that "
                    "your teammate needs but cannot see. Repeat them word for word, e.g. Box A "
                    "holds 7 marbles. Box B holds 5 marbles.",
                    "Passes on the facts it sees."),
        RoleSection("answerer", "You are the Answerer of a two-person team. Your teammate "
                    "reports the facts; you see the question. Answer it in one line: the "
                    "calculation, then the answer in \\boxed{}, e.g. 7 + 5 = \\boxed{12}.",
                    "Answers the question from the reported facts.", max_new_tokens=32)),
    "verify_correct": (
        RoleSection("solver", "You are the Solver of a two-person team. Compute the result step "
                    "by step, one calculation per line, e.g. 4 + 7 = 11\n11 * 2 = 22.",
                    "Writes the calculation."),
        RoleSection("checker", "You are the Checker of a two-person team. Check each line of the "
                    "Solver's calculation and correct any mistake. Reply with only the final "
                    "result in \\boxed{}, e.g. \\boxed{22}.",
                    "Checks the calculation and gives the final answer.")),
    # The planner picks among the task's candidate paths (SmolLM2-135M never wrote a path of
    # its own in eight tries: docs/team_tasks.md); the executor's 32 tokens fit a path of up
    # to 8 moves after "The path from S to G is".
    "grid_path": (
        RoleSection("planner", "You are the Planner of a two-person team. Check which candidate "
                    "path goes from S to G without entering a # wall. Answer in one line, e.g. "
                    "The path from S to G is R D R.", "Writes the moves from S to G."),
        RoleSection("executor", "You are the Executor of a two-person team. Repeat the Planner's "
                    "path in one line, e.g. The path from S to G is R D R.",
                    "Writes the final path.", max_new_tokens=32)),
}
_MATH_TEAMS = {1: ("solver",), 2: ("reasoner", "actor"), 3: ("reasoner", "actor", "verifier"),
               4: ("analyst", "planner", "solver", "verifier")}
_CODE_TEAMS = {2: ("planner", "coder"), 3: ("planner", "coder", "reviewer")}


def shipped(task: str, num_roles: int) -> dict:
  """The shipped team of `task` with `num_roles` roles, as `TeamSection` fields (roles,
  order): the last role in order is graded. A config file writes
  `TeamSection(**shipped("arithmetic", 2), ...)`."""
  if task == "echo":
    names = tuple(f"helper{i}" for i in range(num_roles - 1)) + ("repeater",)
    # Terse, like the task's wording: the rows then fit the update's 64-token bucket (EchoEnv).
    roles = {n: RoleSection(n, "Say it." if n != "repeater" else "Repeat it.",
                            "Says the number." if n != "repeater" else "Repeats it.")
             for n in names}
  elif task in _TEAM_TASK_ROLES:
    roles = {r.name: r for r in _TEAM_TASK_ROLES[task]}
    if num_roles != 2:
      raise ValueError(f"team.num_roles={num_roles}: the shipped {task} team has 2 roles (or "
                       "declare team.roles)")
    names = tuple(r.name for r in _TEAM_TASK_ROLES[task])
  else:
    roles, teams = {"code": (_CODE_ROLES, _CODE_TEAMS),
                    "humaneval": (_CODE_ROLES, _CODE_TEAMS),
                    "math_jsonl": (_WORD_ROLES, _MATH_TEAMS)}.get(task, (_MATH_ROLES, _MATH_TEAMS))
    if task not in ("code", "humaneval") and num_roles == 1:
      roles = {"solver": _WORD_SOLVER if task == "math_jsonl" else _SINGLE_SOLVER}
    if num_roles not in teams:
      raise ValueError(f"team.num_roles={num_roles}: the shipped {task} teams have "
                       f"{sorted(teams)} roles (or declare team.roles)")
    names = teams[num_roles]
  last = names[-1]
  return {"roles": tuple(dataclasses.replace(roles[n], graded=n == last) for n in names),
          "order": ",".join(names)}


def declared(team: TeamSection, task: str) -> tuple[tuple[RoleSection, ...], tuple[str, ...]]:
  """(roles in order, order): the config's own, or the task's shipped team of num_roles."""
  if team.roles:
    by_name = {r.name: r for r in team.roles}
    return tuple(by_name[n] for n in team.role_order), team.role_order
  ship = shipped(task, team.num_roles)
  return ship["roles"], tuple(ship["order"].split(","))


def adapter_ids(team: TeamSection, roles) -> tuple[tuple[int, ...], int]:
  """(each role's adapter index, the orchestrator's or -1) and the number of adapters."""
  if team.shared_adapter:
    return tuple(0 for _ in roles), 0 if team.graph == "orchestrator" else -1, 1
  ids, next_id = [], 0
  for r in roles:
    if r.adapter == "own":
      ids.append(next_id)
      next_id += 1
    else:
      ids.append(NO_ADAPTER)
  if any(r.adapter == "shared" for r in roles):
    ids = [next_id if r.adapter == "shared" else i for r, i in zip(roles, ids)]
    next_id += 1
  orchestrator = -1
  if team.graph == "orchestrator":
    orchestrator, next_id = next_id, next_id + 1
  return tuple(ids), orchestrator, next_id


def num_adapters(team: TeamSection, task: str) -> int:
  roles, _ = declared(team, task)
  return adapter_ids(team, roles)[2]


def adapter_names(team: TeamSection, task: str) -> list[str]:
  """A name per adapter (PEFT exports): its role, "shared", or "orchestrator"."""
  roles, _ = declared(team, task)
  ids, orchestrator, count = adapter_ids(team, roles)
  names = [""] * count
  for r, i in zip(roles, ids):
    if i >= 0:
      names[i] = "shared" if team.shared_adapter or r.adapter == "shared" else r.name
  if orchestrator >= 0 and not team.shared_adapter:
    names[orchestrator] = "orchestrator"
  return names


def role_bases(config) -> dict[str, tuple[str, str]]:
  """{role: (its backbone, that backbone's source)} of a `TrainConfig`'s team."""
  roles, _ = declared(config.team, config.task.name)
  return {r.name: (r.backbone or MAIN_BACKBONE,
                   config.model.backbone(r.backbone or MAIN_BACKBONE).source) for r in roles}
