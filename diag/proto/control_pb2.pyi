from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CommandKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COMMAND_KIND_UNSPECIFIED: _ClassVar[CommandKind]
    COMMAND_KIND_FLUSH: _ClassVar[CommandKind]
    COMMAND_KIND_EXIT: _ClassVar[CommandKind]
    COMMAND_KIND_DUMP: _ClassVar[CommandKind]
    COMMAND_KIND_RECOVER: _ClassVar[CommandKind]
COMMAND_KIND_UNSPECIFIED: CommandKind
COMMAND_KIND_FLUSH: CommandKind
COMMAND_KIND_EXIT: CommandKind
COMMAND_KIND_DUMP: CommandKind
COMMAND_KIND_RECOVER: CommandKind

class RankId(_message.Message):
    __slots__ = ("job", "rank", "world_size", "local_rank", "attempt", "node")
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    job: str
    rank: int
    world_size: int
    local_rank: int
    attempt: int
    node: str
    def __init__(self, job: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., local_rank: _Optional[int] = ..., attempt: _Optional[int] = ..., node: _Optional[str] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("id", "pid", "journal", "save_dir", "start_time", "pid_ns")
    ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    JOURNAL_FIELD_NUMBER: _ClassVar[int]
    SAVE_DIR_FIELD_NUMBER: _ClassVar[int]
    START_TIME_FIELD_NUMBER: _ClassVar[int]
    PID_NS_FIELD_NUMBER: _ClassVar[int]
    id: RankId
    pid: int
    journal: str
    save_dir: str
    start_time: float
    pid_ns: int
    def __init__(self, id: _Optional[_Union[RankId, _Mapping]] = ..., pid: _Optional[int] = ..., journal: _Optional[str] = ..., save_dir: _Optional[str] = ..., start_time: _Optional[float] = ..., pid_ns: _Optional[int] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("agent_pid", "agent_version", "node")
    AGENT_PID_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    agent_pid: int
    agent_version: str
    node: str
    def __init__(self, agent_pid: _Optional[int] = ..., agent_version: _Optional[str] = ..., node: _Optional[str] = ...) -> None: ...

class SubscribeRequest(_message.Message):
    __slots__ = ("id", "pid")
    ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    id: RankId
    pid: int
    def __init__(self, id: _Optional[_Union[RankId, _Mapping]] = ..., pid: _Optional[int] = ...) -> None: ...

class Command(_message.Message):
    __slots__ = ("id", "kind", "reason", "dump_dir", "exit_code", "verdict_time")
    ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DUMP_DIR_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    VERDICT_TIME_FIELD_NUMBER: _ClassVar[int]
    id: str
    kind: CommandKind
    reason: str
    dump_dir: str
    exit_code: int
    verdict_time: float
    def __init__(self, id: _Optional[str] = ..., kind: _Optional[_Union[CommandKind, str]] = ..., reason: _Optional[str] = ..., dump_dir: _Optional[str] = ..., exit_code: _Optional[int] = ..., verdict_time: _Optional[float] = ...) -> None: ...

class PersistAck(_message.Message):
    __slots__ = ("step", "ok", "error", "seconds", "bytes", "committed")
    STEP_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    step: int
    ok: bool
    error: str
    seconds: float
    bytes: int
    committed: bool
    def __init__(self, step: _Optional[int] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., seconds: _Optional[float] = ..., bytes: _Optional[int] = ..., committed: _Optional[bool] = ...) -> None: ...

class ReplicaAck(_message.Message):
    __slots__ = ("on", "step", "run")
    ON_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    on: bool
    step: int
    run: str
    def __init__(self, on: _Optional[bool] = ..., step: _Optional[int] = ..., run: _Optional[str] = ...) -> None: ...

class AgentMessage(_message.Message):
    __slots__ = ("command", "persist_ack", "replica_ack")
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    PERSIST_ACK_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ACK_FIELD_NUMBER: _ClassVar[int]
    command: Command
    persist_ack: PersistAck
    replica_ack: ReplicaAck
    def __init__(self, command: _Optional[_Union[Command, _Mapping]] = ..., persist_ack: _Optional[_Union[PersistAck, _Mapping]] = ..., replica_ack: _Optional[_Union[ReplicaAck, _Mapping]] = ...) -> None: ...

class PersistRequest(_message.Message):
    __slots__ = ("id", "step", "save_dir")
    ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SAVE_DIR_FIELD_NUMBER: _ClassVar[int]
    id: RankId
    step: int
    save_dir: str
    def __init__(self, id: _Optional[_Union[RankId, _Mapping]] = ..., step: _Optional[int] = ..., save_dir: _Optional[str] = ...) -> None: ...

class PersistReply(_message.Message):
    __slots__ = ("accepted", "reason")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class CommandReport(_message.Message):
    __slots__ = ("id", "command_id", "ok", "detail", "step", "path")
    ID_FIELD_NUMBER: _ClassVar[int]
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    id: RankId
    command_id: str
    ok: bool
    detail: str
    step: int
    path: str
    def __init__(self, id: _Optional[_Union[RankId, _Mapping]] = ..., command_id: _Optional[str] = ..., ok: _Optional[bool] = ..., detail: _Optional[str] = ..., step: _Optional[int] = ..., path: _Optional[str] = ...) -> None: ...

class ReportReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: str
    def __init__(self, job: _Optional[str] = ...) -> None: ...

class RankStatus(_message.Message):
    __slots__ = ("rank", "pid", "connected", "memory_step", "persisted_step")
    RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    MEMORY_STEP_FIELD_NUMBER: _ClassVar[int]
    PERSISTED_STEP_FIELD_NUMBER: _ClassVar[int]
    rank: int
    pid: int
    connected: bool
    memory_step: int
    persisted_step: int
    def __init__(self, rank: _Optional[int] = ..., pid: _Optional[int] = ..., connected: _Optional[bool] = ..., memory_step: _Optional[int] = ..., persisted_step: _Optional[int] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("ranks", "committed_step", "save_dir")
    RANKS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_STEP_FIELD_NUMBER: _ClassVar[int]
    SAVE_DIR_FIELD_NUMBER: _ClassVar[int]
    ranks: _containers.RepeatedCompositeFieldContainer[RankStatus]
    committed_step: int
    save_dir: str
    def __init__(self, ranks: _Optional[_Iterable[_Union[RankStatus, _Mapping]]] = ..., committed_step: _Optional[int] = ..., save_dir: _Optional[str] = ...) -> None: ...

class SavedNote(_message.Message):
    __slots__ = ("id", "step")
    ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    id: RankId
    step: int
    def __init__(self, id: _Optional[_Union[RankId, _Mapping]] = ..., step: _Optional[int] = ...) -> None: ...

class SavedReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeNote(_message.Message):
    __slots__ = ("id", "source", "step", "reason", "memory_offered", "held", "run")
    ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MEMORY_OFFERED_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    id: RankId
    source: str
    step: int
    reason: str
    memory_offered: bool
    held: str
    run: str
    def __init__(self, id: _Optional[_Union[RankId, _Mapping]] = ..., source: _Optional[str] = ..., step: _Optional[int] = ..., reason: _Optional[str] = ..., memory_offered: _Optional[bool] = ..., held: _Optional[str] = ..., run: _Optional[str] = ...) -> None: ...

class ResumeReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
