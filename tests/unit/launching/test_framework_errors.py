"""The C++ check that aborted a rank, found in its output (issue 67, item 5). A real OneFlow abort is
tests/test_oneflow_launch.py's; these are the formats, one each."""

from pytest_gpumem.launching.framework_errors import framework_message

DUMP = ("Fatal Python error: Aborted\n\nThread 0x00007f58 (most recent call first):\n"
        "  File \"train.py\", line 10 in step\n")


def test_glogs_fatal_line_is_found_before_the_crash_dump_even_behind_another_processs_output():
    output = ("W20261207 12:51:34.221616  3673 cuda_device_descriptor_class.cpp:48] CUDA driver version is "
              "insufficient\n1 0 F20261207 12:51:12.692564  3382 transport.cpp:107] Check failed: stat->size >= "
              "msg.size (8 vs. 16) \n*** Check failure stack trace: ***\n"
              "    @     0x7f49fa3d30a9  google::LogMessageFatal::~LogMessageFatal()\n" + DUMP)
    assert framework_message(output) == "transport.cpp:107: Check failed: stat->size >= msg.size (8 vs. 16)"


def test_c10s_fatal_line_and_an_uncaught_cpp_exception_are_found_the_earlier_first():
    uncaught = ("terminate called after throwing an instance of 'c10::DistBackendError'\n"
                "  what():  [PG ID 0 PG GUID 0(default_pg) Rank 1] Process group watchdog thread terminated\n")
    fatal = "[F1207 12:00:01.123456789 ProcessGroupNCCL.cpp:1790] [PG 0 Rank 1] Watchdog timed out\n"
    assert framework_message(uncaught + DUMP) == (
        "c10::DistBackendError: [PG ID 0 PG GUID 0(default_pg) Rank 1] Process group watchdog thread terminated")
    assert framework_message(fatal + uncaught) == "ProcessGroupNCCL.cpp:1790: [PG 0 Rank 1] Watchdog timed out"


def test_a_python_exception_or_a_warning_is_no_framework_abort():
    assert framework_message("RuntimeError: (3 vs 4)\nE20261207 12:00:00.000000  1 x.cpp:1] an error, not fatal\n"
                             + DUMP) == ""
