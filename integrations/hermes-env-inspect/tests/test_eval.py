"""A real ``inspect eval`` of a tiny task: mockllm calls ``bash()`` in the ``hermes`` sandbox; the log is read back."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import pytest
from inspect_ai import Task, eval, task
from inspect_ai.dataset import Sample
from inspect_ai.log import read_eval_log
from inspect_ai.model import ModelOutput, ModelUsage, get_model
from inspect_ai.scorer import CORRECT, INCORRECT, Score, Target, accuracy, scorer
from inspect_ai.solver import TaskState, generate, use_tools
from inspect_ai.tool import bash
from inspect_ai.util import SandboxEnvironmentSpec, sandbox

from hermes_env_core import ConfigError
from hermes_env_inspect import HermesSandboxConfig

MODEL = "mockllm/model"


@scorer(metrics=[accuracy()])
def answer_file() -> Any:
    async def score(state: TaskState, target: Target) -> Score:
        try:
            text = await sandbox().read_file("answer.txt")
        except FileNotFoundError:
            return Score(value=INCORRECT, explanation="no answer.txt in the sandbox")
        return Score(value=CORRECT if text.strip() == target.text else INCORRECT, answer=text)

    return score


def _run(sandbox_spec: Any, tmp_path: Path, secret: str) -> Any:
    @task
    def tiny() -> Task:
        return Task(
            dataset=[Sample(input="Put the secret in answer.txt.", target=secret)],
            solver=[use_tools([bash(timeout=60)]), generate()],
            scorer=answer_file(),
            sandbox=sandbox_spec,
        )

    command = f"echo {secret} > answer.txt && echo product=$((6*7)) && echo cwd=$(pwd) && echo oops >&2"
    outputs = [
        ModelOutput.for_tool_call(MODEL, "bash", {"command": command}),
        ModelOutput.from_content(MODEL, "Done: the secret is in answer.txt."),
    ]
    for output in outputs:
        # with usage given, mockllm counts no tokens (its tokenizer would download its tables)
        output.usage = ModelUsage(input_tokens=10, output_tokens=5, total_tokens=15)
    model = get_model(MODEL, custom_outputs=outputs)
    logs = eval(tiny(), model=model, log_dir=str(tmp_path / "logs"), display="none", log_format="json")
    assert len(logs) == 1
    return read_eval_log(logs[0].location)


def _tool_output(log: Any) -> str:
    assert log.samples is not None and len(log.samples) == 1
    sample = log.samples[0]
    tool_messages = [m for m in sample.messages if m.role == "tool"]
    assert len(tool_messages) == 1, sample.messages
    assert tool_messages[0].function == "bash"
    assert tool_messages[0].error is None, tool_messages[0].error
    return str(tool_messages[0].text)


def test_eval_with_a_toml_config_on_local(tmp_path: Path) -> None:
    config = tmp_path / "hermes-env.toml"
    config.write_text('[terminal]\nenv = "local"\ntimeout = 120\n')
    secret = uuid.uuid4().hex
    log = _run(("hermes", str(config)), tmp_path, secret)
    assert log.status == "success", log.error
    assert log.eval.sandbox.type == "hermes"
    output = _tool_output(log)
    assert "product=42\n" in output
    assert "oops\n" in output  # bash() puts stderr first
    cwd = output.split("cwd=", 1)[1].split("\n", 1)[0]
    assert cwd.startswith("/") and cwd != os.getcwd()  # a directory of the sample's own
    assert not Path(cwd).exists()  # removed at sample cleanup
    sample = log.samples[0]
    assert sample.scores["answer_file"].value == CORRECT
    assert sample.scores["answer_file"].answer.strip() == secret
    assert log.results.scores[0].metrics["accuracy"].value == 1.0


def test_eval_with_a_config_object_on_docker(tmp_path: Path, test_image: str) -> None:
    secret = uuid.uuid4().hex
    spec = SandboxEnvironmentSpec("hermes", HermesSandboxConfig(backend="docker", options={"image": test_image}))
    log = _run(spec, tmp_path, secret)
    assert log.status == "success", log.error
    # the config object went into the log and came back as the same model
    assert log.eval.sandbox.config == HermesSandboxConfig(backend="docker", options={"image": test_image})
    output = _tool_output(log)
    assert "product=42\n" in output
    assert "cwd=/workspace\n" in output  # the container's own working directory
    assert log.samples[0].scores["answer_file"].value == CORRECT


def test_a_bad_backend_option_fails_the_task_with_its_name(tmp_path: Path) -> None:
    config = tmp_path / "hermes-env.toml"
    config.write_text('[terminal]\nenv = "local"\n\n[terminal.local]\nno_such_option = 1\n')
    # task_init resolves the config: the eval stops before any sample, naming the option and the file
    with pytest.raises(ConfigError, match=r"unknown option 'no_such_option' for backend 'local'.*hermes-env.toml"):
        _run(("hermes", str(config)), tmp_path, "x")


@pytest.fixture(autouse=True)
def _no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    # mockllm needs none; make sure nothing reaches for a provider's key either
    for var in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "INSPECT_EVAL_MODEL"):
        monkeypatch.delenv(var, raising=False)
