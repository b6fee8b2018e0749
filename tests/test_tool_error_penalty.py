"""env.tool_error_penalty and env.no_call_penalty: training reward lost per failed tool call
(capped) and per turn without a call, never in eval."""

import pytest

from support import small_config
from tiderl.config import ConfigError, load_config
from tiderl.rewards.tool_errors import NO_CALL_PART, PART, penalize_no_call_turns, penalize_tool_errors
from tiderl.run import build_run
from tiderl.types import Trajectory


def trajectory(reward: float, **info) -> Trajectory:
    return Trajectory(tokens=[1, 2], loss_mask=[0, 1], behavior_logprobs=[0.0, -1.0], policy_version=[-1, 0],
                      reward=reward, reward_parts={"outcome": reward}, task_id="t", env_info=info)


def test_penalty_per_error_capped_and_recorded():
    shaped = penalize_tool_errors(trajectory(1.0, tool_errors=3), 0.1, 4)
    assert shaped.reward == pytest.approx(0.7)
    assert shaped.reward_parts == {"outcome": 1.0, PART: pytest.approx(-0.3)}
    assert penalize_tool_errors(trajectory(0.0, tool_errors=9), 0.1, 4).reward == pytest.approx(-0.4)
    assert penalize_tool_errors(trajectory(0.0, tool_errors=0), 0.1, 4).reward == 0.0


def test_penalty_refuses_missing_counts_and_double_shaping():
    with pytest.raises(ValueError, match="env_info\\['tool_errors'\\]"):
        penalize_tool_errors(trajectory(0.0), 0.1, 4)
    with pytest.raises(ValueError, match="once"):
        penalize_tool_errors(penalize_tool_errors(trajectory(0.0, tool_errors=1), 0.1, 4), 0.1, 4)


def test_no_call_penalty_per_turn_recorded_and_refused_without_a_count():
    shaped = penalize_no_call_turns(trajectory(1.0, no_call_turns=2), 0.05)
    assert shaped.reward == pytest.approx(0.9)
    assert shaped.reward_parts == {"outcome": 1.0, NO_CALL_PART: pytest.approx(-0.1)}
    assert penalize_no_call_turns(trajectory(0.0, no_call_turns=0), 0.05).reward == 0.0
    with pytest.raises(ValueError, match="no_call_turns"):
        penalize_no_call_turns(trajectory(0.0), 0.05)
    with pytest.raises(ValueError, match="once"):
        penalize_no_call_turns(penalize_no_call_turns(trajectory(0.0, no_call_turns=1), 0.05), 0.05)


@pytest.mark.parametrize("field", ["env.tool_error_penalty", "env.no_call_penalty"])
def test_negative_penalty_is_a_config_error(field):
    with pytest.raises(ConfigError, match=field):
        load_config("configs/kg_sao_tiny.yaml", [f"{field}=-0.1"])


@pytest.mark.slow
def test_the_run_shapes_training_trajectories_with_it(cache, tmp_path):
    on = build_run(small_config(cache, tmp_path / "on", "env.tool_error_penalty=0.05"))
    shaped = on.shape(trajectory(1.0, tool_errors=2, success=1.0))
    assert shaped.reward == pytest.approx(0.9) and shaped.reward_parts[PART] == pytest.approx(-0.1)
    # env.max_turns (4 in this config) caps the count.
    assert on.shape(trajectory(0.0, tool_errors=50)).reward == pytest.approx(-0.05 * on.cfg.env.max_turns)
    off = build_run(small_config(cache, tmp_path / "off"))
    assert PART not in off.shape(trajectory(1.0, tool_errors=2, success=1.0)).reward_parts


@pytest.mark.slow
def test_the_run_charges_turns_without_a_call_beside_tool_errors(cache, tmp_path):
    run = build_run(small_config(cache, tmp_path / "both", "env.tool_error_penalty=0.05", "env.no_call_penalty=0.1"))
    shaped = run.shape(trajectory(0.0, tool_errors=1, no_call_turns=2))
    assert shaped.reward == pytest.approx(-0.25)
    assert shaped.reward_parts[PART] == pytest.approx(-0.05) and shaped.reward_parts[NO_CALL_PART] == pytest.approx(-0.2)
