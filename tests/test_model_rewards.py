"""Rewards from models (tiderl/rewards/model.py, judge.py): a tiny randomly initialised
Qwen2ForSequenceClassification built here (no download) scores conversations; the reward that
reaches a trajectory is weight * score + rule_weight * rule reward, and a run trains with it.
A generative judge is asked over HTTP, here a local stub of an OpenAI-compatible server."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler

import pytest
import torch
from transformers import Qwen2ForSequenceClassification

from support import CORPUS, QuietHTTPServer, rollout, small_config
from tiderl.config import ConfigError, load_config
from tiderl.embedded.tiny import tiny_qwen2_config, train_tokenizer
from tiderl.rewards import judge
from tiderl.rewards.judge import Judge, JudgeOptions, render
from tiderl.rewards.model import PART, ModelRewards, RewardConfig, RewardModel, RewardModelOptions, conversation_of
from tiderl.types import Trajectory

CHAT = [{"role": "user", "content": "Who directed film_004?"}, {"role": "assistant", "content": "person_5 did."}]


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(CORPUS, vocab_size=320)


@pytest.fixture(scope="module")
def reward_dir(tok, tmp_path_factory):
    """A saved tiny reward model (num_labels=1) and its tokenizer."""
    config = tiny_qwen2_config(len(tok), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    config.num_labels = 1
    torch.manual_seed(0)
    model = Qwen2ForSequenceClassification(config)
    with torch.no_grad():  # a random head gives scores near 0; spread them so the sums are checked
        model.score.weight.mul_(50.0)
    path = tmp_path_factory.mktemp("rm")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def independent_score(path, messages) -> float:
    """The reward model's score of one conversation, unpadded, without RewardModel."""
    from transformers import AutoTokenizer

    model = Qwen2ForSequenceClassification.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        return float(model(input_ids=torch.tensor([ids])).logits[0, 0])


def trajectory(tok, messages, reward, task_id="t1") -> Trajectory:
    ids = tok(tok.apply_chat_template(messages, tokenize=False), add_special_tokens=False)["input_ids"]
    n = len(ids)
    return Trajectory(tokens=ids, loss_mask=[0] * n, behavior_logprobs=[0.0] * n, policy_version=[-1] * n,
                      reward=reward, reward_parts={"outcome": reward}, task_id=task_id)


def scorer(path, batch_size=2):
    from transformers import AutoTokenizer

    model = Qwen2ForSequenceClassification.from_pretrained(path)
    return RewardModel(model, AutoTokenizer.from_pretrained(path), RewardModelOptions(str(path), batch_size=batch_size))


def loaded(path, tok, weight=0.5, rule_weight=2.0):
    return ModelRewards({PART: (weight, scorer(path))}, rule_weight, tok)


def test_conversation_is_read_back_from_chatml():
    text = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"
    assert conversation_of(text) == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert conversation_of("plain text") == [{"role": "user", "content": "plain text"}]


def test_batched_scores_equal_one_at_a_time(reward_dir, tok):
    rm = scorer(reward_dir, batch_size=3)
    chats = [CHAT, CHAT[:1], [{"role": "user", "content": "film_017 " * 9}], [CHAT[1]]]  # different lengths
    batched = rm.scores(chats)
    assert batched == pytest.approx([independent_score(reward_dir, c) for c in chats], abs=1e-4)
    assert len(set(round(s, 3) for s in batched)) > 1  # the scores differ, so a mix-up would show


def test_the_reward_is_weight_times_score_plus_rule_weight_times_rule(reward_dir, tok):
    rm = loaded(reward_dir, tok, weight=0.5, rule_weight=2.0)
    trajs = [trajectory(tok, CHAT, 1.0, "a"), trajectory(tok, CHAT[:1], 0.0, "b"), trajectory(tok, CHAT, 0.25, "c")]
    shaped = rm.shape(trajs)
    for t, s in zip(trajs, shaped):
        score = independent_score(reward_dir, conversation_of(tok.decode(t.tokens, skip_special_tokens=False)))
        assert s.reward == pytest.approx(0.5 * score + 2.0 * t.reward, abs=1e-4)
        assert s.reward_parts[PART] == pytest.approx(0.5 * score, abs=1e-4)
        assert sum(s.reward_parts.values()) == pytest.approx(s.reward)
    with pytest.raises(ValueError, match="task 'a'.*once"):
        rm.shape(shaped[:1])


def test_a_failure_names_the_task(reward_dir, tok, monkeypatch):
    rm = loaded(reward_dir, tok)
    monkeypatch.setattr(rm.scorers[PART][1].model, "forward", lambda **kw: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="task\\(s\\) task_7.*boom"):
        rm.shape([trajectory(tok, CHAT, 1.0, "task_7")])


def test_options_are_listed_checked_and_typos_get_a_suggestion():
    from tiderl.options import describe

    keys = {k for k, _, _ in describe(RewardConfig, "reward.")}
    assert {"reward.model.path", "reward.model.weight", "reward.rule_weight"} <= keys
    with pytest.raises(ConfigError, match="Did you mean 'weight'"):
        load_config("configs/kg_sao_tiny.yaml", ["reward.model.wieght=0.5"])
    with pytest.raises(ConfigError, match="reward.rule_weight"):  # nothing reads it without a reward model
        load_config("configs/kg_sao_tiny.yaml", ["reward.rule_weight=0.5"])
    with pytest.raises(ConfigError, match="reward.model.batch_size: must be >= 1"):
        load_config("configs/kg_sao_tiny.yaml", ["reward.model.path=x", "reward.model.batch_size=0"])


@pytest.mark.slow
def test_a_run_shapes_with_the_reward_model_and_trains(reward_dir, cache, tmp_path):
    from tiderl.recipe import train
    from tiderl.run import build_run

    run = build_run(small_config(cache, tmp_path / "run", f"reward.model.path={reward_dir}",
                                 "reward.model.weight=0.5", "reward.rule_weight=2.0", "train.steps=2"))
    assert run.model_rewards is not None
    played = rollout(run, run.setup.train_tasks[:2])
    for t in played:
        (shaped,) = run.model_rewards.shape([t])
        messages = conversation_of(run.tokenizer.decode(t.tokens, skip_special_tokens=False))
        assert messages[-1]["role"] == "assistant"  # the policy's ChatML turns were read back
        expected = 0.5 * independent_score(reward_dir, messages) + 2.0 * t.reward
        assert shaped.reward == pytest.approx(expected, abs=1e-4), t.task_id
    seen = []
    history, _ = train(run, observer=lambda version, metrics, batch: seen.extend(batch))
    assert len(history) == 2 and seen
    # Every trained episode was scored on its way from the backend (tiderl/rewards/scoring.py), in
    # batches of at most reward.model.batch_size, and its reward holds the weighted score.
    assert all(PART in t.reward_parts for t in seen)
    for t in seen:
        assert t.reward == pytest.approx(sum(t.reward_parts.values()), abs=1e-5)
        assert t.reward_parts[PART] == pytest.approx(0.5 * t.env_info[f"{PART}/score"], abs=1e-6)


# -- a generative judge over an OpenAI-compatible URL -----------------------------------------


class _JudgeStub(BaseHTTPRequestHandler):
    """/v1/chat/completions answering "Score: N" with N = the number of 'x' in the prompt; a prompt
    with "slow" waits 2 s, one with "mute" answers without a number."""

    seen: list = []

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = body["messages"][-1]["content"]
        _JudgeStub.seen.append((self.path, body["model"], prompt))
        if "slow" in prompt:
            time.sleep(2.0)
        answer = "I cannot say" if "mute" in prompt else f"Score: {prompt.count('x')}"
        data = json.dumps({"choices": [{"message": {"role": "assistant", "content": answer}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture(scope="module")
def judge_url():
    server = QuietHTTPServer(("127.0.0.1", 0), _JudgeStub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()


def test_the_judge_scores_through_its_prompt(judge_url):
    options = JudgeOptions(url=judge_url, model="stub", prompt="Grade: {conversation}", max_score=10.0)
    chats = [[{"role": "user", "content": "xxx"}], [{"role": "assistant", "content": "x" * 7}]]
    assert Judge(options).scores(chats, ["a", "b"]) == pytest.approx([0.3, 0.7])
    assert ("/v1/chat/completions", "stub", "Grade: user: xxx") in _JudgeStub.seen
    assert render("{conversation}!", CHAT) == "user: Who directed film_004?\n\nassistant: person_5 did.!"


def test_the_judge_combines_with_the_reward_model_and_the_rule(reward_dir, tok, judge_url):
    rewards = ModelRewards({PART: (0.5, scorer(reward_dir)),
                            judge.PART: (3.0, Judge(JudgeOptions(url=judge_url, prompt="{conversation}")))}, 2.0, tok)
    chat = [{"role": "user", "content": "xx"}, {"role": "assistant", "content": "xxxx"}]
    (shaped,) = rewards.shape([trajectory(tok, chat, 1.0, "t")])
    assert shaped.reward == pytest.approx(0.5 * independent_score(reward_dir, chat) + 3.0 * 0.6 + 2.0 * 1.0, abs=1e-4)
    assert shaped.reward_parts[judge.PART] == pytest.approx(1.8) and shaped.env_info["judge/score"] == pytest.approx(0.6)


@pytest.mark.parametrize("content, problem", [("slow", "no answer within reward.judge.timeout_s=0.5"),
                                              ("mute", "the answer has no score")])
def test_judge_failures_name_the_task(judge_url, content, problem):
    options = JudgeOptions(url=judge_url, timeout_s=0.5)
    with pytest.raises(RuntimeError, match=f"on task task_9: {problem}"):
        Judge(options).scores([[{"role": "user", "content": content}]], ["task_9"])


def test_an_unreachable_judge_names_the_task():
    with pytest.raises(RuntimeError, match="judge at http://127.0.0.1:9/v1 on task t3"):
        Judge(JudgeOptions(url="http://127.0.0.1:9/v1", timeout_s=2)).scores([CHAT], ["t3"])


def test_judge_options_are_checked():
    with pytest.raises(ConfigError, match="reward.judge.prompt: has no {conversation}"):
        load_config("configs/kg_sao_tiny.yaml", ["reward.judge.url=http://x/v1", "reward.judge.prompt=rate it"])
    with pytest.raises(ConfigError, match="reward.judge.weight"):  # no judge: nothing reads it
        load_config("configs/kg_sao_tiny.yaml", ["reward.judge.weight=2"])
