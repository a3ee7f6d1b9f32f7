// Named barrier ids of the sm90 forward (0 is __syncthreads). One table so
// that the mainloop's and the epilogue's ids never collide.
#pragma once

namespace jax_flash::sm90 {

constexpr int kBarEpilogue = 1;  // + consumer WG index: the WG's own 128 threads
constexpr int kBarSched = 4;     // + consumer WG index: "this WG may issue its GEMMs" (pingpong)
constexpr int kBarOWrite = 13;   // all consumer WGs (O in the V ring): every WG is past its last PV
constexpr int kBarVarlenV = 14;  // all consumer WGs (varlen): the V tail rows are zeroed

}  // namespace jax_flash::sm90
