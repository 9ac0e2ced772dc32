"""``[environment.tools]``: the built-in tools environment and its sandbox (torch-free)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

ToolName = Literal["calculator", "python"]


class SandboxConfig(BaseModel):
    """How Python code runs: a separate process per run, confined and limited.

    The code runs in new user, PID, IPC, UTS, network (unless ``network``) and mount
    (unless ``private_filesystem = false``) namespaces: it sees the interpreter and system
    libraries read-only, a private tmpfs as its only writable directory, no process of
    the trainer and no network. A host that cannot provide an isolation asked for (user
    namespaces disabled) makes the run refuse to start instead of running unconfined.
    """

    model_config = ConfigDict(extra="forbid")

    cpu_seconds: float = Field(default=5.0, gt=0, description="CPU time per run.")
    wall_seconds: float = Field(default=10.0, gt=0,
                                description="Wall-clock time per run; then it is killed.")
    memory_mb: int = Field(default=512, ge=64, description="Address space per process.")
    max_processes: int = Field(default=16, gt=0,
                               description="Processes and threads the code may run at once.")
    max_output_bytes: int = Field(default=65536, gt=0,
                                  description="stdout + stderr; more kills the run.")
    max_file_mb: int = Field(default=16, gt=0, description="Size of any file written.")
    disk_mb: int = Field(default=64, gt=0,
                         description="Size of the private writable directory (a tmpfs).")
    network: bool = Field(
        default=False,
        description="false: no network (a network namespace of its own); a host that cannot "
        "create one refuses to start the run. true: the host's network.")
    private_filesystem: bool = Field(
        default=True,
        description="true: only the interpreter and system libraries (read-only) and a "
        "private tmpfs are visible. false: the host's files, as the run's user (limits "
        "and the other namespaces still apply).")
    read_only_paths: list[str] = Field(
        default_factory=list,
        description="More directories or files shown read-only (e.g. a site-packages).")
    python: str | None = Field(
        default=None, description="Interpreter that runs the code (default: the base "
        "interpreter of this one, without its virtual environment).")


class RemoteToolsConfig(BaseModel):
    """``[environment.tools.remote]``: tools run by a reward service
    (``reasonctl serve-rewards`` with ``[tools] serve``), for sandboxes that must not share
    the trainer's host."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(min_length=1, description="The service, http(s)://host[:port].")
    token_env: str = Field(default="REASONCTL_REWARD_TOKEN",
                           description="Environment variable holding the bearer token.")
    tools: list[ToolName] = Field(default_factory=lambda: ["python"], min_length=1,
                                  description="Which of the tools run on the service.")
    timeout: float = Field(default=60.0, gt=0,
                           description="Seconds per call, retries included; then the call "
                           "is answered with an error.")


class ToolsEnvironmentConfig(BaseModel):
    """``[environment.tools]``: which tools the policy may call and how they run."""

    model_config = ConfigDict(extra="forbid")

    tools: list[ToolName] = Field(
        default_factory=lambda: ["calculator", "python"], min_length=1,
        description="calculator: arithmetic (a parser, no code runs); python: code run in "
        "the sandbox, its output returned.")
    max_result_chars: int = Field(
        default=2000, gt=0, description="A tool result longer than this is cut.")
    error_penalty: float = Field(
        default=0.0, ge=0,
        description="The environment's reward: minus this for each tool error of the "
        "episode (a malformed call, an unknown tool, a failed run), so the policy learns to "
        "call tools correctly. 0: the environment gives no reward of its own.")
    describe_tools: bool = Field(
        default=True,
        description="Give the tools' schemas to the chat template, which describes them in "
        "the prompt (for templates that take tools, e.g. Qwen2.5/Qwen3).")
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    remote: RemoteToolsConfig | None = Field(
        default=None, description="Run some of the tools on a reward service instead of here.")
