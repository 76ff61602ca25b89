from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PySpyFrame(_message.Message):
    __slots__ = ("func_name", "file_name", "module")
    FUNC_NAME_FIELD_NUMBER: _ClassVar[int]
    FILE_NAME_FIELD_NUMBER: _ClassVar[int]
    MODULE_FIELD_NUMBER: _ClassVar[int]
    func_name: str
    file_name: str
    module: str
    def __init__(self, func_name: _Optional[str] = ..., file_name: _Optional[str] = ..., module: _Optional[str] = ...) -> None: ...

class PySpyStacktrace(_message.Message):
    __slots__ = ("pid", "thread_id", "thread_name", "os_thread_id", "active", "owns_gil", "frames")
    PID_FIELD_NUMBER: _ClassVar[int]
    THREAD_ID_FIELD_NUMBER: _ClassVar[int]
    THREAD_NAME_FIELD_NUMBER: _ClassVar[int]
    OS_THREAD_ID_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    OWNS_GIL_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    pid: int
    thread_id: int
    thread_name: str
    os_thread_id: int
    active: bool
    owns_gil: bool
    frames: _containers.RepeatedCompositeFieldContainer[PySpyFrame]
    def __init__(self, pid: _Optional[int] = ..., thread_id: _Optional[int] = ..., thread_name: _Optional[str] = ..., os_thread_id: _Optional[int] = ..., active: _Optional[bool] = ..., owns_gil: _Optional[bool] = ..., frames: _Optional[_Iterable[_Union[PySpyFrame, _Mapping]]] = ...) -> None: ...

class PstackFrame(_message.Message):
    __slots__ = ("func_name", "file_name")
    FUNC_NAME_FIELD_NUMBER: _ClassVar[int]
    FILE_NAME_FIELD_NUMBER: _ClassVar[int]
    func_name: str
    file_name: str
    def __init__(self, func_name: _Optional[str] = ..., file_name: _Optional[str] = ...) -> None: ...

class PstackStacktrace(_message.Message):
    __slots__ = ("pid", "thread_name", "frames")
    PID_FIELD_NUMBER: _ClassVar[int]
    THREAD_NAME_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    pid: int
    thread_name: str
    frames: _containers.RepeatedCompositeFieldContainer[PstackFrame]
    def __init__(self, pid: _Optional[int] = ..., thread_name: _Optional[str] = ..., frames: _Optional[_Iterable[_Union[PstackFrame, _Mapping]]] = ...) -> None: ...

class Stacktrace(_message.Message):
    __slots__ = ("stacktrace", "py_stacktrace", "pid", "rank", "pstack_stdout", "pstack_stderr", "pyspy_stdout", "pyspy_stderr", "process_state")
    STACKTRACE_FIELD_NUMBER: _ClassVar[int]
    PY_STACKTRACE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    PSTACK_STDOUT_FIELD_NUMBER: _ClassVar[int]
    PSTACK_STDERR_FIELD_NUMBER: _ClassVar[int]
    PYSPY_STDOUT_FIELD_NUMBER: _ClassVar[int]
    PYSPY_STDERR_FIELD_NUMBER: _ClassVar[int]
    PROCESS_STATE_FIELD_NUMBER: _ClassVar[int]
    stacktrace: _containers.RepeatedCompositeFieldContainer[PstackStacktrace]
    py_stacktrace: _containers.RepeatedCompositeFieldContainer[PySpyStacktrace]
    pid: int
    rank: int
    pstack_stdout: str
    pstack_stderr: str
    pyspy_stdout: str
    pyspy_stderr: str
    process_state: str
    def __init__(self, stacktrace: _Optional[_Iterable[_Union[PstackStacktrace, _Mapping]]] = ..., py_stacktrace: _Optional[_Iterable[_Union[PySpyStacktrace, _Mapping]]] = ..., pid: _Optional[int] = ..., rank: _Optional[int] = ..., pstack_stdout: _Optional[str] = ..., pstack_stderr: _Optional[str] = ..., pyspy_stdout: _Optional[str] = ..., pyspy_stderr: _Optional[str] = ..., process_state: _Optional[str] = ...) -> None: ...
