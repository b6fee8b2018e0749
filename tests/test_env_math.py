"""The math environment: answer extraction, the calculator, bounded math-verify checks, the
episode rules (reward, format penalty, tools, errors), the data readers and oracle ceilings,
the contract checker, and config rules."""

import json

import pytest

from tiderl.config import ConfigError, load_config
from tiderl.envs.check import assert_environment
from tiderl.envs.math.calculator import Bounds, CalculatorError, calculate
from tiderl.envs.math.data import (ARITHMETIC_KINDS, BENCHMARK_FILES, arithmetic_tasks, gsm8k_answer,
                                   integer_text, load_benchmark)
from tiderl.envs.math.env import MathEnv
from tiderl.envs.math.extract import extract_answer, last_boxed
from tiderl.envs.math.setup import oracle_turns
from tiderl.envs.math.verify import MAX_ANSWER_CHARS, AnswerVerifier
from tiderl.envs.protocol import Action, Task, ToolCall
from tiderl.envs.setup import data_root, load_setup


@pytest.fixture(scope="module")
def verifier():
    v = AnswerVerifier(timeout_s=30.0)  # generous: these tests are not about timeouts
    yield v
    v.close()


def task(answer="936", prompt="What is 347 plus 589?", **meta):
    return Task("t0", prompt, answer, meta)


# -- extraction ----------------------------------------------------------------------------


@pytest.mark.parametrize("text, answer, source", [
    ("so \\boxed{18}.", "18", "boxed"),
    ("first \\boxed{1} then \\boxed{2}", "2", "boxed"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", "boxed"),
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}", "boxed"),               # escaped braces are literal
    ("\\boxed{x \\boxed{3}}", "x \\boxed{3}", "boxed"),            # the outer box closes last
    ("\\fbox{7}", "7", "boxed"),
    ("\\boxed{5} and an unbalanced \\boxed{6", "5", "boxed"),
    ("Final Answer: $42$.", "42", "final_answer"),
    ("final answer: 3\nmore text", "3", "final_answer"),
    ("work...\n#### 1,600", "1,600", "hash"),
    ("\\boxed{", None, "none"),
    ("no answer here", None, "none"),
    ("", None, "none"),
])
def test_extract_answer(text, answer, source):
    got = extract_answer(text)
    assert (got.answer, got.source) == (answer, source)


@pytest.mark.parametrize("text, answer, source", [
    ("One times 419 is 419.", "419", "last_number"),
    ("There are 3 whole tens in 35, so 30 remain... no: 1,200 in all", "1200", "last_number"),
    ("It is -2.5 degrees", "-2.5", "last_number"),
    ("12 apples, so \\boxed{7}", "7", "boxed"),            # a marker still wins
    ("Final Answer: 8 (not 9)", "8 (not 9)", "final_answer"),
    ("no number at all", None, "none"),
])
def test_the_last_number_fallback_reads_answers_without_a_marker(text, answer, source):
    got = extract_answer(text, fallback="last_number")
    assert (got.answer, got.source) == (answer, source)
    if source == "last_number":
        assert extract_answer(text).source == "none"  # off unless asked for
    with pytest.raises(ValueError, match="last_number"):
        extract_answer(text, fallback="first_number")


@pytest.mark.timeout(60)  # linear: well under a second; quadratic would take hours and time out
def test_extraction_is_linear_on_enormous_nested_text():
    text = "\\boxed{" * 100_000 + "1" + "}" * 99_999  # one box never closes
    # The box closed last is the second outermost: everything between its braces.
    assert last_boxed(text) == "\\boxed{" * 99_998 + "1" + "}" * 99_998


# -- the calculator --------------------------------------------------------------------------


@pytest.mark.parametrize("expression, value", [
    ("347 + 589", "936"), ("(20 - 5) / 3", "5"), ("7/2", "3.5"), ("1/3", "0.333333333333"),
    ("2**10", "1024"), ("-3 // 2", "-2"), ("17 % 5", "2"), ("0.1 + 0.2", "0.3"), ("12 × 3", "36"),
])
def test_calculator_values(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize("expression, message", [
    ("__import__('os').system('true')", "not allowed"), ("open('x')", "not allowed"),
    ("x + 1", "not allowed"), ("2^3", r"write \*\*"), ("1/0", "division by zero"),
    ("9**9**9", "too large"), ("10**40", "range"), ("1e400", "too large"), ("", "empty"),
    ("1" * 500, "characters"), ("-" * 150 + "1", "too long"), ("1 +", "cannot parse"),
    ("2 ** 0.5", "integer exponents"), ("[1, 2]", "not allowed"), ("'a' * 3", "not a number"),
])
@pytest.mark.timeout(60)  # rejected before evaluation: 9**9**9 evaluated first would run for many minutes
def test_calculator_rejects_with_a_reason(expression, message):
    with pytest.raises(CalculatorError, match=message):
        calculate(expression)


def test_calculator_bounds_are_configurable():
    with pytest.raises(CalculatorError, match="range"):
        calculate("1000 * 1000", Bounds(max_magnitude=10**5))


# -- math-verify, bounded --------------------------------------------------------------------


@pytest.mark.parametrize("gold, predicted, correct", [
    ("18", "18", True), ("18", "18.0", True), ("18", "19", False), ("1600", "1,600", True),
    ("\\frac{14}{3}", "14/3", True), ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3, \\pi/2)", True),
    ("25", "025", True), ("0.5", "\\frac{1}{2}", True), ("\\sqrt{51}", "7", False),
])
def test_verifier_decides_equivalence(verifier, gold, predicted, correct):
    assert verifier.verify(gold, predicted).correct is correct


@pytest.mark.timeout(120)  # a hostile input that were not cut off would hang here
def test_verifier_bounds_hostile_input_and_recovers():
    v = AnswerVerifier(timeout_s=30.0)  # the calls that must finish get time to spare on a busy machine
    try:
        assert v.verify("2", "2").correct  # the worker runs
        v.timeout_s = 0.3
        verdict = v.verify("5", "2^{2^{2^{2^{2^{2^{2}}}}}}")  # sympy would compute a giant power, never in 0.3 s
        assert not verdict.correct and "timed out" in verdict.error
        assert v.timeouts == 1  # the worker was cut off (and killed) once
        v.timeout_s = 30.0
        assert v.verify("3", "3").correct  # a fresh worker replaced the killed one
        too_long = v.verify("1", "1" * (MAX_ANSWER_CHARS + 1))
        assert not too_long.correct and "characters" in too_long.error
        assert not v.verify("1", "\ud800").correct  # a lone surrogate is just a wrong answer
    finally:
        v.close()


def test_verifier_is_usable_from_threads(verifier):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(6) as pool:
        verdicts = list(pool.map(lambda i: verifier.verify(str(i), f"{i}.0"), range(24)))
    assert all(v.correct for v in verdicts)


# -- the environment -------------------------------------------------------------------------


def test_single_turn_reward_and_parts(verifier):
    env = MathEnv(verifier)
    assert env.tool_schemas() == []
    env.reset(task())
    r = env.step(Action("347 + 589 = 936, so \\boxed{936}"))
    assert r.done and r.reward == 1.0 and r.info["success"] == 1.0
    assert r.info["reward_parts"] == {"outcome": 1.0, "format": -0.0} and r.info["answer"] == "936"
    env.reset(task())
    r = env.step(Action("\\boxed{935}"))
    assert r.done and r.reward == 0.0 and r.info["success"] == 0.0
    env.reset(task())  # single-turn: a tool call is just text, the turn is the answer
    r = env.step(Action("<tool_call>{}</tool_call>", [ToolCall("calculator", {"expression": "1"})]))
    assert r.done and r.reward == 0.0 and r.info["answer_source"] == "none"


def test_format_penalty_is_off_by_default_and_applies_to_unboxed_answers(verifier):
    env = MathEnv(verifier, format_penalty=0.2)
    env.reset(task())
    r = env.step(Action("Final Answer: 936"))
    assert r.info["success"] == 1.0 and r.reward == pytest.approx(0.8)
    assert sum(r.info["reward_parts"].values()) == pytest.approx(r.reward)
    env.reset(task())
    r = env.step(Action("\\boxed{936}"))
    assert r.reward == 1.0
    env.reset(task())
    r = env.finish("max_turns")
    assert r.done and r.reward == pytest.approx(-0.2) and r.info["success"] == 0.0
    plain = MathEnv(verifier)
    plain.reset(task())
    assert plain.step(Action("Final Answer: 936")).reward == 1.0


@pytest.mark.parametrize("text, answer, source", [
    ("775 / 100 = 7", None, "none"),                         # working at the cut, not an answer
    ("Final Answer: 77", None, "none"),                      # the line may go on (775)
    ("Final Answer: 775\nBecause 7 hundreds", "775", "final_answer"),  # a finished line counts
    ("#### 12\n#### 1", "12", "hash"),                       # the last finished one
    ("So \\boxed{775} since 7", "775", "boxed"),             # a closed box counts
])
def test_a_cut_answer_counts_only_what_the_model_finished(text, answer, source):
    got = extract_answer(text, fallback="last_number", cut=True)
    assert (got.answer, got.source) == (answer, source)
    assert extract_answer(text, fallback="last_number").answer is not None  # uncut, each is read


def test_the_answer_fallback_refuses_a_cut_turn(verifier):
    env = MathEnv(verifier, answer_fallback="last_number")
    env.reset(task())
    r = env.step(Action("347 and 589 make 936", cut=True))
    assert r.info["success"] == 0.0 and r.info["answer_source"] == "none" and r.info["answer_cut"] is True
    env.reset(task())
    assert env.step(Action("347 and 589 make 936")).info["success"] == 1.0


def test_the_answer_fallback_scores_a_sentence_and_still_pays_the_format_penalty(verifier):
    env = MathEnv(verifier, format_penalty=0.1, answer_fallback="last_number")
    env.reset(task())
    r = env.step(Action("347 and 589 make 936."))
    assert r.info["success"] == 1.0 and r.info["answer_source"] == "last_number"
    assert r.reward == pytest.approx(0.9)  # unboxed: the penalty applies
    env.reset(task())
    assert env.step(Action("347 and 589 make 935.")).info["success"] == 0.0
    strict = MathEnv(verifier)
    strict.reset(task())
    assert strict.step(Action("347 and 589 make 936.")).info["success"] == 0.0
    with pytest.raises(ValueError, match="fallback"):
        MathEnv(verifier, answer_fallback="first")


def test_multi_turn_calculator_episode(verifier):
    env = MathEnv(verifier, tools=True)
    assert [s["function"]["name"] for s in env.tool_schemas()] == ["calculator"]
    env.reset(task())
    r = env.step(Action("", [ToolCall("calculator", {"expression": "347 + 589"})]))
    assert not r.done and r.observations == ["936"] and r.info["tool_calls"] == 1
    r = env.step(Action("", [ToolCall("calculator", {"expression": "9**9**9"}),
                             ToolCall("search", {"q": "x"}),
                             ToolCall("calculator", {"expr": "1"}),
                             ToolCall("calculator", {"expression": ["1"]}),
                             ToolCall("calculator", {"expression": 12})],
                        ["tool call 1: invalid JSON"]))
    assert not r.done and len(r.observations) == 6
    assert all(o.startswith("Error:") for o in r.observations[:5]) and r.observations[5] == "12"
    assert r.info["tool_errors"] == 5
    r = env.step(Action("The calculator says 936. \\boxed{936}"))
    assert r.done and r.reward == 1.0 and r.info["tool_calls"] == 7


def test_step_after_the_end_or_before_reset_raises(verifier):
    env = MathEnv(verifier)
    with pytest.raises(RuntimeError, match="reset"):
        env.step(Action("\\boxed{1}"))
    env.reset(task())
    env.step(Action("\\boxed{1}"))
    with pytest.raises(RuntimeError, match="already ended"):
        env.step(Action("\\boxed{1}"))
    with pytest.raises(RuntimeError, match="reset"):
        env.finish("max_turns")
    env.reset(task())
    assert env.step(Action("\\boxed{936}")).reward == 1.0  # reset starts a new episode


def test_observations_and_info_are_valid_text(verifier):
    env = MathEnv(verifier, tools=True)
    env.reset(task(prompt="bad \ud800 text"))
    r = env.step(Action("", [ToolCall("calc\udfff", {"expression": "1"}),
                             ToolCall("calculator", {"expression": "\ud800"})]))
    for o in r.observations:
        o.encode("utf-8")
    r = env.step(Action("\\boxed{\udc00}"))
    json.dumps(r.info).encode("utf-8")
    r.info["answer"].encode("utf-8")


def test_contract_checker_single_and_multi_turn():
    assert_environment("math", "data.source=arithmetic").ok
    assert_environment("math", "data.source=arithmetic", "env.options.calculator=true").ok


def test_oracle_turns():
    t = Task("a", "What is 2 plus 3?", "5", {"expression": "2 + 3"})
    assert oracle_turns(t, tools=False) == ["The answer is \\boxed{5}."]
    first, last = oracle_turns(t, tools=True)
    assert '"calculator"' in first and "2 + 3" in first and last.endswith("\\boxed{5}.")


# -- data ------------------------------------------------------------------------------------


def test_arithmetic_tasks_are_seeded_disjoint_and_correct():
    train, held = arithmetic_tasks(3, 400, 100)
    again, _ = arithmetic_tasks(3, 400, 100)
    assert [t.prompt for t in train] == [t.prompt for t in again]
    assert len(train) == 400 and len(held) == 100
    assert not {t.prompt for t in train} & {t.prompt for t in held}
    assert {t.meta["kind"] for t in held} == {k.name for k in ARITHMETIC_KINDS}
    for t in train + held:
        assert calculate(t.meta["expression"]) == t.answer
        assert t.meta["confusion"] != t.meta["expression"]
    assert [t.prompt for t in arithmetic_tasks(4, 400, 100)[0]] != [t.prompt for t in train]


def test_answer_normalisation():
    assert gsm8k_answer("...\n#### 1,600") == "1600"
    assert gsm8k_answer("#### -3") == "-3"
    assert integer_text("025", "x") == "25" and integer_text(27.0, "x") == "27"
    with pytest.raises(ValueError, match="digits"):
        integer_text("9" * 100, "x")
    with pytest.raises(ValueError, match="integer"):
        integer_text("2.5", "x")
    with pytest.raises(ValueError, match="####"):
        gsm8k_answer("no marker")


SIZES = {"gsm8k": 1319, "math500": 500, "aime24": 30, "aime25": 30, "amc23": 40}


def _need(source):
    root = data_root()
    if not (root / BENCHMARK_FILES[source]).is_file():
        pytest.skip(f"{BENCHMARK_FILES[source]} not found under {root} (set TIDERL_DATA_DIR)")
    return root


@pytest.mark.data
@pytest.mark.parametrize("source", list(SIZES))
def test_readers(source):
    tasks = load_benchmark(_need(source), source)
    assert len(tasks) == SIZES[source] and len({t.task_id for t in tasks}) == len(tasks)
    assert all(t.prompt.strip() and str(t.answer).strip() for t in tasks)
    if source != "math500":
        assert all(t.answer.lstrip("-").isdigit() for t in tasks)


@pytest.mark.data
@pytest.mark.parametrize("source", list(SIZES))
def test_oracle_ceiling_through_tiderl_eval(source, tmp_path, capsys):
    from tiderl.cli import main

    _need(source)
    out = tmp_path / "oracle.json"
    assert main(["eval", "--env", "math", "--data", source, "--oracle", "--json", str(out),
                 "data.eval_size=40"]) == 0
    result = json.loads(out.read_text())["greedy"]
    assert result["n"] == min(40, SIZES[source]) and result["success"] >= 0.99


# -- config -----------------------------------------------------------------------------------


def test_config_rules():
    cfg = load_config(None, ["env.name=math", "data.source=gsm8k", "env.options.calculator=true"])
    assert cfg.env.options.calculator
    with pytest.raises(ConfigError, match="env.options.calculator"):
        load_config(None, ["env.options.calculator=true"])  # env.name=kg does not read it
    with pytest.raises(ConfigError, match="env.options.backend"):
        load_config(None, ["env.name=math", "data.source=arithmetic", "env.options.backend=duckdb"])
    with pytest.raises(ConfigError, match="data.source"):
        load_config(None, ["env.name=math", "data.source=metaqa"])
    with pytest.raises(ConfigError, match="env.options.verify_timeout_s"):
        load_config(None, ["env.name=math", "data.source=arithmetic", "env.options.verify_timeout_s=0"])
    load_config("configs/math_arith_sao_tiny.yaml")
    with pytest.raises(ConfigError, match="env.options.answer_fallback.*last_number"):
        load_config(None, ["env.name=math", "data.source=arithmetic", "env.options.answer_fallback=first"])
    cfg = load_config(None, ["env.name=math", "data.source=arithmetic", "env.options.answer_fallback=last_number"])
    setup = load_setup(cfg)
    env = setup.make_env()
    env.reset(setup.eval_tasks[0])
    assert env.step(Action(f"It is {setup.eval_tasks[0].answer}.")).info["success"] == 1.0


def test_setup_errors_name_the_fix(tmp_path):
    cfg = load_config(None, ["env.name=math", "data.source=aime24", f"data.data_dir={tmp_path}"])
    with pytest.raises(FileNotFoundError, match="data.data_dir"):
        load_setup(cfg)


def test_check_env_command_defaults_to_arithmetic(capsys):
    from tiderl.cli import main

    assert main(["check-env", "math"]) == 0
    assert "0 failed" in capsys.readouterr().out
