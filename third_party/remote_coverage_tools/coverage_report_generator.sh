#!/bin/sh
echo "llmq: bazel coverage is not supported offline (stand-in remote_coverage_tools)" >&2
exit 1
