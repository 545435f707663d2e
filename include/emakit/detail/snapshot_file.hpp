// Moved: the serialization layer lives in detail/serial/ (see detail/serial/formats.hpp).
#pragma once

#include <emakit/detail/serial/snapshot_file.hpp>
