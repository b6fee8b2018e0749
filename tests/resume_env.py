"""Environments for the checkpoint tests (`tests/test_checkpoint_resume.py`), importable by name
from a `tiderl train` subprocess (`env.name=resume_env:LengthReward`)."""

from __future__ import annotations

from tiderl.envs.protocol import StepResult

from user_env import ParityEnv


class LengthReward(ParityEnv):
    """One turn per episode, rewarded by the length of what the model wrote: an untrained model
    gets rewards that differ between samples, so the actor and the critic both learn."""

    def step(self, action):
        reward = (len(action.text) % 7) / 6.0
        return StepResult([], reward=reward, done=True, info={"success": float(reward >= 1.0)})


class NaNReward(ParityEnv):
    """Every episode ends at its first step with a NaN reward (a broken reward function)."""

    def step(self, action):
        return StepResult([], reward=float("nan"), done=True, info={"success": 0.0})


class ResetFails(ParityEnv):
    """An environment whose every reset fails (its database is down)."""

    def reset(self, task):
        raise ConnectionError("database at db.example:5432 refused the connection")


class ResetFailsAfterStartUp(ParityEnv):
    """Resets work for tiderl's start-up check, then every later one fails (the database went
    down once the run had started): the scheduler, not the start-up check, must name it."""

    resets = 0
    START_UP_RESETS = 16  # tiderl.models.startup checks this many tasks' prompts

    def reset(self, task):
        type(self).resets += 1
        if type(self).resets > self.START_UP_RESETS:
            raise ConnectionError("database at db.example:5432 refused the connection")
        return super().reset(task)
