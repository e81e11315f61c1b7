"""Background processes (the core's ``processes`` registry) on direct mode, whose
commands run on the session server: the session's state reaches them, input,
output, exit and kill work through the sandbox's execs."""

from __future__ import annotations

import uuid

from hermes_env_modal import ModalEnvironment

from hermes_env_core.processes import NotificationKind, PollSettings, ProcessRegistry


def test_background_process_sees_the_session_and_takes_input_and_a_kill(modal_emu):
    with ModalEnvironment(mode="direct", task_id=f"bg-{uuid.uuid4().hex[:8]}") as env, ProcessRegistry(
        poll=PollSettings(min_s=0.02, max_s=0.25, factor=2.0)
    ) as registry:
        assert env.session_mode == "server"
        env.execute("export HBG_T='a b'; hbg_fn() { echo fn \"$1\"; }; cd /tmp")
        p = registry.spawn(env, 'echo "$HBG_T|$PWD"; hbg_fn ok; read -r line; echo "got $line"; exit 3')
        assert p.wait_for_output("fn ok", timeout=30)
        p.write("hello\n")
        assert p.wait(30) == 3
        assert p.output == "a b|/tmp\nfn ok\ngot hello\n"
        exited = registry.next_notification(10)
        assert exited is not None and exited.kind is NotificationKind.EXIT and exited.exit_code == 3

        q = registry.spawn(env, "echo up; sleep 600")
        assert q.wait_for_output("up", timeout=30)
        q.kill(grace=1)
        assert q.wait(30) is not None
        # The session itself went on untouched.
        assert env.execute('echo "$HBG_T"; pwd').output == "a b\n/tmp\n"
