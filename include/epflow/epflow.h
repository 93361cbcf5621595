// EPFlow public API: include this.
#pragma once

#include "epflow/communicator.h"
#include "epflow/config.h"
#include "epflow/layer.h"
#include "epflow/status.h"
