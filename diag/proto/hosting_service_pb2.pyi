from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DeviceStatus(_message.Message):
    __slots__ = ("block_range", "thread_range", "stack_trace", "sass", "has_next", "hang_step", "hang_sass", "registers")
    class RegistersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    BLOCK_RANGE_FIELD_NUMBER: _ClassVar[int]
    THREAD_RANGE_FIELD_NUMBER: _ClassVar[int]
    STACK_TRACE_FIELD_NUMBER: _ClassVar[int]
    SASS_FIELD_NUMBER: _ClassVar[int]
    HAS_NEXT_FIELD_NUMBER: _ClassVar[int]
    HANG_STEP_FIELD_NUMBER: _ClassVar[int]
    HANG_SASS_FIELD_NUMBER: _ClassVar[int]
    REGISTERS_FIELD_NUMBER: _ClassVar[int]
    block_range: str
    thread_range: str
    stack_trace: _containers.RepeatedScalarFieldContainer[str]
    sass: str
    has_next: bool
    hang_step: int
    hang_sass: _containers.RepeatedScalarFieldContainer[str]
    registers: _containers.ScalarMap[str, int]
    def __init__(self, block_range: _Optional[str] = ..., thread_range: _Optional[str] = ..., stack_trace: _Optional[_Iterable[str]] = ..., sass: _Optional[str] = ..., has_next: _Optional[bool] = ..., hang_step: _Optional[int] = ..., hang_sass: _Optional[_Iterable[str]] = ..., registers: _Optional[_Mapping[str, int]] = ...) -> None: ...

class CudaStackFrame(_message.Message):
    __slots__ = ("device_func", "curr_location", "curr_symbol", "inlined_location", "block", "thread", "kernel_args", "sass")
    DEVICE_FUNC_FIELD_NUMBER: _ClassVar[int]
    CURR_LOCATION_FIELD_NUMBER: _ClassVar[int]
    CURR_SYMBOL_FIELD_NUMBER: _ClassVar[int]
    INLINED_LOCATION_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    THREAD_FIELD_NUMBER: _ClassVar[int]
    KERNEL_ARGS_FIELD_NUMBER: _ClassVar[int]
    SASS_FIELD_NUMBER: _ClassVar[int]
    device_func: str
    curr_location: str
    curr_symbol: str
    inlined_location: str
    block: str
    thread: str
    kernel_args: str
    sass: str
    def __init__(self, device_func: _Optional[str] = ..., curr_location: _Optional[str] = ..., curr_symbol: _Optional[str] = ..., inlined_location: _Optional[str] = ..., block: _Optional[str] = ..., thread: _Optional[str] = ..., kernel_args: _Optional[str] = ..., sass: _Optional[str] = ...) -> None: ...

class DeviceFrame(_message.Message):
    __slots__ = ("cuda_frame", "stderr", "origin")
    CUDA_FRAME_FIELD_NUMBER: _ClassVar[int]
    STDERR_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    cuda_frame: CudaStackFrame
    stderr: str
    origin: str
    def __init__(self, cuda_frame: _Optional[_Union[CudaStackFrame, _Mapping]] = ..., stderr: _Optional[str] = ..., origin: _Optional[str] = ...) -> None: ...

class DeviceStacktrace(_message.Message):
    __slots__ = ("devices_frames",)
    DEVICES_FRAMES_FIELD_NUMBER: _ClassVar[int]
    devices_frames: _containers.RepeatedCompositeFieldContainer[DeviceFrame]
    def __init__(self, devices_frames: _Optional[_Iterable[_Union[DeviceFrame, _Mapping]]] = ...) -> None: ...

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
    __slots__ = ("func_name", "file_name", "origin")
    FUNC_NAME_FIELD_NUMBER: _ClassVar[int]
    FILE_NAME_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    func_name: str
    file_name: str
    origin: str
    def __init__(self, func_name: _Optional[str] = ..., file_name: _Optional[str] = ..., origin: _Optional[str] = ...) -> None: ...

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
    __slots__ = ("stacktrace", "py_stacktrace", "pid", "rank", "pstack_stdout", "pstack_stderr", "pyspy_stdout", "pyspy_stderr", "device_stacktrace", "device_status", "process_state")
    STACKTRACE_FIELD_NUMBER: _ClassVar[int]
    PY_STACKTRACE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    PSTACK_STDOUT_FIELD_NUMBER: _ClassVar[int]
    PSTACK_STDERR_FIELD_NUMBER: _ClassVar[int]
    PYSPY_STDOUT_FIELD_NUMBER: _ClassVar[int]
    PYSPY_STDERR_FIELD_NUMBER: _ClassVar[int]
    DEVICE_STACKTRACE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_STATUS_FIELD_NUMBER: _ClassVar[int]
    PROCESS_STATE_FIELD_NUMBER: _ClassVar[int]
    stacktrace: _containers.RepeatedCompositeFieldContainer[PstackStacktrace]
    py_stacktrace: _containers.RepeatedCompositeFieldContainer[PySpyStacktrace]
    pid: int
    rank: int
    pstack_stdout: str
    pstack_stderr: str
    pyspy_stdout: str
    pyspy_stderr: str
    device_stacktrace: _containers.RepeatedCompositeFieldContainer[DeviceStacktrace]
    device_status: _containers.RepeatedCompositeFieldContainer[DeviceStatus]
    process_state: str
    def __init__(self, stacktrace: _Optional[_Iterable[_Union[PstackStacktrace, _Mapping]]] = ..., py_stacktrace: _Optional[_Iterable[_Union[PySpyStacktrace, _Mapping]]] = ..., pid: _Optional[int] = ..., rank: _Optional[int] = ..., pstack_stdout: _Optional[str] = ..., pstack_stderr: _Optional[str] = ..., pyspy_stdout: _Optional[str] = ..., pyspy_stderr: _Optional[str] = ..., device_stacktrace: _Optional[_Iterable[_Union[DeviceStacktrace, _Mapping]]] = ..., device_status: _Optional[_Iterable[_Union[DeviceStatus, _Mapping]]] = ..., process_state: _Optional[str] = ...) -> None: ...
