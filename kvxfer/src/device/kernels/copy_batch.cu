// kvxfer's batched device copy: one launch runs one table of copies
// (kvxfer_proto::copy_batch::CopyBatch: three arrays of n entries, src, dst and len, in device
// memory). A thread block takes an entry at a time (grid-stride), its threads copy 16 bytes
// each where source and destination agree modulo 16 (every KV block does), else single bytes.
// Source and destination may be this device's memory, a peer's opened through CUDA IPC, or
// host memory mapped for the device (the staged path's pinned chunks).
//
// The PTX beside this file is what kvxfer loads (through cudarc, at run time: building
// kvxfer needs no CUDA toolkit). Regenerate it after any change with
//     python3 scripts/gen-ptx.py
// which compiles with NVRTC 12.0 from PyPI for compute_70: PTX ISA 8.0 loads on any driver
// of CUDA 12.0 or later and JIT-compiles for every GPU from Volta on.
// `scripts/gen-ptx.py --check` (run by scripts/test.sh) fails when the two differ, and
// assembles the PTX with ptxas for sm_80 and sm_90.

typedef unsigned long long u64;

extern "C" __global__ void kvx_copy_batch(const u64* __restrict__ src,
                                          const u64* __restrict__ dst,
                                          const u64* __restrict__ len,
                                          unsigned int n)
{
    for (unsigned int e = blockIdx.x; e < n; e += gridDim.x) {
        const unsigned char* s = (const unsigned char*)src[e];
        unsigned char* d = (unsigned char*)dst[e];
        u64 l = len[e];
        u64 head = 0;
        u64 body = 0;
        if ((((u64)s ^ (u64)d) & 15) == 0) {
            // Bytes up to the first 16-byte boundary, then whole 16-byte words.
            head = (16 - ((u64)s & 15)) & 15;
            if (head > l) {
                head = l;
            }
            body = (l - head) >> 4;
        }
        u64 tail_at = head + (body << 4);
        for (u64 i = threadIdx.x; i < head; i += blockDim.x) {
            d[i] = s[i];
        }
        const uint4* s4 = (const uint4*)(s + head);
        uint4* d4 = (uint4*)(d + head);
        for (u64 i = threadIdx.x; i < body; i += blockDim.x) {
            d4[i] = s4[i];
        }
        for (u64 i = tail_at + threadIdx.x; i < l; i += blockDim.x) {
            d[i] = s[i];
        }
    }
}
