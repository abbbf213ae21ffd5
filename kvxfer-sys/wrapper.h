#include <ucp/api/ucp.h>
#include <ucs/type/status.h>
#include <stdio.h>
#include <ucs/debug/log_def.h>
