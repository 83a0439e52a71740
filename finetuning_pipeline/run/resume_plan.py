"""Where each phase of a run starts, from `--resume` and what is on disk, and whether that
start is allowed: the resume policy of `main.py`.

  --resume auto    finished phases are skipped while what they were built on is unchanged
                   (check_finished_phase); an unfinished one continues from its newest
                   checkpoint that verifies (a damaged newer one is skipped, and said).
  --resume never   a fresh start; --force replaces only a run's own phase directories.
  --resume DIR     that checkpoint.
A resume under settings that would change the result is refused by name (check_resumable),
unless only optimisation settings changed and the user passed --accept-changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from finetuning_pipeline.errors import ConfigError
from finetuning_pipeline.run.checkpointing import (
    BASE_WEIGHTS_KEY,
    changed_resume_keys,
    checkpoint_step,
    data_content_key,
    newest_intact_checkpoint,
    read_json,
    resume_keys,
    saved_resume_keys,
    verify_checkpoint,
)
from finetuning_pipeline.run.run_layout import RunLayout
from finetuning_pipeline.run_config import RunConfig, phase_number


@dataclass
class PhasePlan:
    phase: int
    resume_from: Path | None  # a complete checkpoint, or None to start the phase fresh
    replace: bool = False  # --resume never --force: the master removes the phase's old outputs first
    accepted_changes: dict | None = None  # --accept-changes: {setting: [saved, now]} at the resume


def plan_phases(config: RunConfig, phases: list[int], resume: str, force: bool, say=print) -> list[PhasePlan]:
    """Which phases to run and where each starts, from --resume and what is on disk.
    say: where the plan's notes go (print on the master process, nowhere on the others)."""
    layout = RunLayout(config.output_dir)
    if resume == "auto":
        plans = []
        for phase in phases:
            if layout.summary(phase).is_file():
                check_finished_phase(config, phase, say)
                continue
            try:
                newest = newest_intact_checkpoint(layout.checkpoints(phase), report=say)
            except ValueError as err:
                raise ConfigError(f"--resume auto: {err}. Start phase {phase} over with --phase {phase} --resume never "
                                  "--force, or pass --resume CHECKPOINT_DIR") from None
            plans.append(PhasePlan(phase, newest))
            if newest is not None:
                say(resuming(phase, newest))
        return plans
    if resume == "never":
        existing = [layout.phase_dir(p) for p in phases if layout.phase_dir(p).exists()]
        if existing and not force:
            raise ConfigError(f"--resume never: {existing[0]} already exists; pass --force to replace it, "
                              "or use --resume auto to continue")
        for phase in phases:
            foreign = layout.foreign_entries(phase)
            if foreign:
                raise ConfigError(f"--resume never --force: {layout.phase_dir(phase)} holds {foreign[0]}, which no run "
                                  "wrote; --force replaces only a run's own outputs. Move it away, or choose another "
                                  "output_dir")
        return [PhasePlan(p, None, replace=layout.phase_dir(p).exists()) for p in phases]
    checkpoint = Path(resume)
    try:
        verify_checkpoint(checkpoint)
    except (FileNotFoundError, ValueError) as err:
        raise ConfigError(f"--resume: {err}") from None
    phase = read_json(checkpoint / "trainer_state.json")["phase"]
    if phase not in phases:
        raise ConfigError(f"--resume: {checkpoint} is a phase-{phase} checkpoint but --phase selects {phases}")
    say(resuming(phase, checkpoint))
    return [PhasePlan(phase, checkpoint)] + [PhasePlan(p, None) for p in phases if p > phase]


def resuming(phase: int, checkpoint: Path) -> str:
    return f"phase {phase}: resuming from step {checkpoint_step(checkpoint)} ({checkpoint})"


def check_resumable(config: RunConfig, plans: list[PhasePlan], accept_changes: bool = False, say=print) -> None:
    """Refuse to resume a checkpoint under settings, or on prepared data, that would change
    the result, naming each change. (Keys a checkpoint does not record, from an older version,
    are not compared.) With accept_changes, optimisation settings may differ: the plan records
    them and the run says it is no longer exact."""
    for plan in plans:
        if plan.resume_from is None:
            continue
        saved = saved_resume_keys(read_json(plan.resume_from / "trainer_state.json"))
        current = resume_keys(config, plan.phase)
        changed = changed_resume_keys(saved, current)
        if changed and accept_changes:
            fixed = [k for k in changed if not tunable_on_resume(k)]
            if fixed:
                raise ConfigError(f"--accept-changes: {plan.resume_from} cannot continue under another "
                                  + ", ".join(f"{k} ({saved[k]!r} -> {current[k]!r})" for k in fixed)
                                  + ": the checkpoint's weights, data position or random streams belong to the old "
                                  "one. Restore it, or start over with --resume never --force")
            plan.accepted_changes = {k: [saved[k], current[k]] for k in changed}
            say(f"phase {plan.phase}: resuming {plan.resume_from} with changed settings ("
                + ", ".join(f"{k}: {saved[k]!r} -> {current[k]!r}" for k in changed)
                + "); the run is no longer the one an uninterrupted run would give (recorded in the summary)")
            continue
        if changed:
            details = ", ".join(f"{k}: {saved.get(k)!r} -> {current.get(k)!r}" for k in changed)
            hint = "".join(f" (the prepared data in {data} is not what the checkpoint trained on: it was prepared "
                           "again from other inputs or options)" for key, data in data_keys(config, plan.phase).items()
                           if key in changed)
            for earlier in adapter_phases(changed):
                hint += (f" (phase {earlier} was trained again since this phase-{plan.phase} checkpoint was built on "
                         "its adapter)")
            if f"phase{plan.phase}.adapters" in changed:
                hint += (f" (the phase trains another set of adapters now: list the checkpoint's "
                         f"{saved[f'phase{plan.phase}.adapters']} again, or start the phase over with --phase "
                         f"{plan.phase} --resume never --force; their order may change)")
            if BASE_WEIGHTS_KEY in changed:
                hint += (f" (the files in {config.model.path} are not the base the checkpoint trained on: another "
                         "model, or the same one saved again; point model.path at the base it trained on)")
            if "model.revision" in changed:
                hint += (f" (the Hub model's revision is another commit now: set model.revision="
                         f"{saved.get('model.revision')} to resume on the weights the checkpoint trained)")
            raise ConfigError(
                f"--resume: {plan.resume_from} was saved under other settings ({details}){hint}; resuming would not "
                "give the run you started. Restore them, start over with --resume never --force, or (optimisation "
                "settings only) continue anyway with --accept-changes"
            )


# What --accept-changes lets differ at a resume: how the optimizer steps, not what it trains
# (model, LoRA shape, data, seed: the checkpoint's weights and data position would not fit).
TUNABLE_ON_RESUME = frozenset({
    "train.lr", "train.warmup_steps", "train.min_lr_ratio", "train.weight_decay", "train.betas", "train.eps",
    "train.max_grad_norm", "train.max_steps", "train.loss_chunk_tokens",
})
# The same of any phase's own section (phaseN.lr, phaseN.max_steps).
TUNABLE_PHASE_KEYS = frozenset({"lr", "max_steps"})


def phase_key(key: str) -> tuple[int | None, str]:
    """(N, "lr") for a resume key "phaseN.lr", and for an adapter's "phaseN.adapters.<name>.lr"
    (adapters side by side: the same settings, each adapter's own); (None, key) for any other."""
    section, _, name = key.partition(".")
    number = phase_number(section)
    if number is not None and name.startswith("adapters."):
        name = name.split(".", 2)[2]
    return (number, name) if number is not None else (None, key)


def tunable_on_resume(key: str) -> bool:
    number, name = phase_key(key)
    return key in TUNABLE_ON_RESUME or (number is not None and name in TUNABLE_PHASE_KEYS)


def data_keys(config: RunConfig, phase: int) -> dict[str, str]:
    """The resume key of each of the phase's prepared data (resume_keys) -> its directory."""
    return {data_content_key(config, phase, name): data for name, data in config.data_dirs(phase).items()}


def adapter_phases(keys) -> list[int]:
    """The earlier phases whose adapters are among `keys` (resume keys `phaseN.adapter`)."""
    return sorted(number for number, name in map(phase_key, keys) if number is not None and name == "adapter")


def is_phase_input(key: str) -> bool:
    """What a phase is built on: when one changed, its finished outputs no longer belong to
    this config (the base, the phase's prepared data, the earlier adapters it builds on)."""
    number, name = phase_key(key)
    return key in ("model.path", "model.revision", BASE_WEIGHTS_KEY) or (
        number is not None and name in ("data.content", "adapter", "adapters"))


def check_finished_phase(config: RunConfig, phase: int, say) -> None:
    """A finished phase is skipped by --resume auto, unless what it was built on changed since
    (a re-prepared dataset, another base, an earlier phase it builds on trained again): then it is
    refused, naming the change. Other changed settings are pointed out, not refused."""
    layout = RunLayout(config.output_dir)
    try:
        saved = saved_resume_keys(read_json(layout.summary(phase)))
    except ValueError as err:
        raise ConfigError(
            f"--resume auto: {err}; rerun the phase with --phase {phase} --resume never --force"
        ) from None
    current = resume_keys(config, phase)
    changed = changed_resume_keys(saved, current)
    inputs = [k for k in changed if is_phase_input(k)]
    if inputs:
        prepared_again = {key: f"{data} was prepared again from other inputs"
                          for key, data in data_keys(config, phase).items()}
        why = {**prepared_again,
               "model.path": "the base model is another one",
               BASE_WEIGHTS_KEY: f"the base model's weights in {config.model.path} are other ones",
               "model.revision": "the base model's Hub revision is another commit",
               **{f"phase{n}.adapter": f"phase {n} was trained again since phase {phase} was built on its adapter"
                  for n in adapter_phases(inputs)}}
        raise ConfigError(
            f"phase {phase} ({layout.phase_dir(phase)}) finished on other inputs: "
            + "; ".join(why.get(k, k) for k in inputs)
            + f". Train it again on these with --phase {phase} --resume never --force, or restore them"
        )
    note = ""
    if changed:
        note = (
            " (it finished under other settings: "
            + ", ".join(f"{k}: {saved[k]!r} -> {current[k]!r}" for k in changed)
            + f"; to train it with these, pass --phase {phase} --resume never --force)"
        )
    say(f"phase {phase}: already finished ({layout.summary(phase)}); skipping{note}")
