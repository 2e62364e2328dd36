// The AVX2 Q8_0 tile GEMM's inner loop in three forms, same arithmetic, timed in one process
// (docs/BENCHMARKS.md, "An AMD EPYC with AVX-512"): what the x86-avx2 Q8_0 prompt path does and
// what it could do.
//   A (schedules/cpu/int8_gemv.py's GEMV, and its GEMM before E): a tile block is 4 rows x 32 bytes; per row of x the four
//     rows' int32x8 dots are folded by two rounds of vphaddd (lanes r and r + 4: row r).
//   B: the same block stored as 4 vectors, vector j holding bytes 8j..8j+7 of rows 0..3; per row of
//     x its 8 bytes j are broadcast (vpbroadcastq) and the four dots summed by vpaddd (lanes 2r and
//     2r + 1: row r). No horizontal adds.
//   E (the kernel since): A's layout regrouped in registers once per block (vpunpck{l,h}dq, then
//     vpunpck{l,h}qdq: vector j holds dword j of rows 0..3 in lanes 0-3 and dword j + 4 in lanes
//     4-7); per row of x one vpshufd spreads x's dwords j and j + 4 the same way, and vpaddd sums.
//     Lanes r and r + 4 hold row r's bytes 0-15 and 16-31 as in A, so A and E agree exactly.
// k = 576, n = 3072, 510 rows of x, 6 rows of x per pass, one thread, integer dots scaled by a float
// per block as the kernel does. Checks that A, B and E agree, then prints GMAC/s (best of 15 each).
//     gcc -O2 -mavx2 -mfma -o q8_0_avx2_fold tests/bench/q8_0_avx2_fold.c && ./q8_0_avx2_fold
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#define NB 18      // k = 576
#define NT 768     // n = 3072 (4 rows a tile)
#define M 510
#define CH 6
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static inline __m256i dot(__m256i w, __m256i x){
  const __m256i ones=_mm256_set1_epi16(1);
  return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w,w),_mm256_sign_epi8(x,w)),ones);}
__attribute__((noinline)) void runA(const int8_t*w,const int8_t*x,float*y){
  for(int t=0;t<NT;t++) for(int p=0;p<M;p+=CH){
    __m256 acc[CH]; for(int i=0;i<CH;i++) acc[i]=_mm256_setzero_ps();
    for(int b=0;b<NB;b++){
      const int8_t*wb=w+((size_t)t*NB+b)*128;
      __m256i w0=_mm256_loadu_si256((const __m256i*)wb),w1=_mm256_loadu_si256((const __m256i*)(wb+32)),
              w2=_mm256_loadu_si256((const __m256i*)(wb+64)),w3=_mm256_loadu_si256((const __m256i*)(wb+96));
      __m256 s=_mm256_set1_ps(0.01f+b);
      for(int i=0;i<CH;i++){
        __m256i xv=_mm256_loadu_si256((const __m256i*)(x+((size_t)(p+i)*NB+b)*32));
        __m256i h=_mm256_hadd_epi32(_mm256_hadd_epi32(dot(w0,xv),dot(w1,xv)),_mm256_hadd_epi32(dot(w2,xv),dot(w3,xv)));
        acc[i]=_mm256_fmadd_ps(_mm256_cvtepi32_ps(h),s,acc[i]);}}
    for(int i=0;i<CH;i++){float v[8];_mm256_storeu_ps(v,acc[i]);for(int r=0;r<4;r++)y[(size_t)(p+i)*NT*4+t*4+r]=v[r]+v[r+4];}}}
__attribute__((noinline)) void runB(const int8_t*w,const int8_t*x,float*y){
  for(int t=0;t<NT;t++) for(int p=0;p<M;p+=CH){
    __m256 acc[CH]; for(int i=0;i<CH;i++) acc[i]=_mm256_setzero_ps();
    for(int b=0;b<NB;b++){
      const int8_t*wb=w+((size_t)t*NB+b)*128;  // 4 vectors: j-th holds bytes 8j..8j+7 of rows 0..3
      __m256i w0=_mm256_loadu_si256((const __m256i*)wb),w1=_mm256_loadu_si256((const __m256i*)(wb+32)),
              w2=_mm256_loadu_si256((const __m256i*)(wb+64)),w3=_mm256_loadu_si256((const __m256i*)(wb+96));
      __m256 s=_mm256_set1_ps(0.01f+b);
      for(int i=0;i<CH;i++){
        const int64_t*xr=(const int64_t*)(x+((size_t)(p+i)*NB+b)*32);
        __m256i d=_mm256_add_epi32(_mm256_add_epi32(dot(w0,_mm256_set1_epi64x(xr[0])),dot(w1,_mm256_set1_epi64x(xr[1]))),
                                   _mm256_add_epi32(dot(w2,_mm256_set1_epi64x(xr[2])),dot(w3,_mm256_set1_epi64x(xr[3]))));
        acc[i]=_mm256_fmadd_ps(_mm256_cvtepi32_ps(d),s,acc[i]);}}
    for(int i=0;i<CH;i++){float v[8];_mm256_storeu_ps(v,acc[i]);for(int r=0;r<4;r++)y[(size_t)(p+i)*NT*4+t*4+r]=v[2*r]+v[2*r+1];}}}
__attribute__((noinline)) void runE(const int8_t*w,const int8_t*x,float*y){
  for(int t=0;t<NT;t++) for(int p=0;p<M;p+=CH){
    __m256 acc[CH]; for(int i=0;i<CH;i++) acc[i]=_mm256_setzero_ps();
    for(int b=0;b<NB;b++){
      const int8_t*wb=w+((size_t)t*NB+b)*128;
      __m256i r0=_mm256_loadu_si256((const __m256i*)wb),r1=_mm256_loadu_si256((const __m256i*)(wb+32)),
              r2=_mm256_loadu_si256((const __m256i*)(wb+64)),r3=_mm256_loadu_si256((const __m256i*)(wb+96));
      __m256i t0=_mm256_unpacklo_epi32(r0,r1),t1=_mm256_unpackhi_epi32(r0,r1),
              t2=_mm256_unpacklo_epi32(r2,r3),t3=_mm256_unpackhi_epi32(r2,r3);
      __m256i w0=_mm256_unpacklo_epi64(t0,t2),w1=_mm256_unpackhi_epi64(t0,t2),
              w2=_mm256_unpacklo_epi64(t1,t3),w3=_mm256_unpackhi_epi64(t1,t3);
      __m256 s=_mm256_set1_ps(0.01f+b);
      for(int i=0;i<CH;i++){
        __m256i xv=_mm256_loadu_si256((const __m256i*)(x+((size_t)(p+i)*NB+b)*32));
        __m256i d=_mm256_add_epi32(_mm256_add_epi32(dot(w0,_mm256_shuffle_epi32(xv,0x00)),dot(w1,_mm256_shuffle_epi32(xv,0x55))),
                                   _mm256_add_epi32(dot(w2,_mm256_shuffle_epi32(xv,0xaa)),dot(w3,_mm256_shuffle_epi32(xv,0xff))));
        acc[i]=_mm256_fmadd_ps(_mm256_cvtepi32_ps(d),s,acc[i]);}}
    for(int i=0;i<CH;i++){float v[8];_mm256_storeu_ps(v,acc[i]);for(int r=0;r<4;r++)y[(size_t)(p+i)*NT*4+t*4+r]=v[r]+v[r+4];}}}
int main(){
  size_t nw=(size_t)NT*NB*128, nx=(size_t)M*NB*32;
  int8_t*w=aligned_alloc(64,nw),*wB=aligned_alloc(64,nw),*x=aligned_alloc(64,nx);
  float*yA=malloc(sizeof(float)*M*NT*4),*yB=malloc(sizeof(float)*M*NT*4);
  srand(1); for(size_t i=0;i<nw;i++) w[i]=(rand()%255)-127; for(size_t i=0;i<nx;i++) x[i]=(rand()%255)-127;
  for(size_t tb=0;tb<(size_t)NT*NB;tb++) for(int r=0;r<4;r++) for(int c=0;c<32;c++)
    wB[tb*128+(c/8)*32+r*8+c%8]=w[tb*128+r*32+c];
  runA(w,x,yA); runB(wB,x,yB);
  double md=0; for(size_t i=0;i<(size_t)M*NT*4;i++){double d=yA[i]-yB[i]; if(d<0)d=-d; if(d>md)md=d;}
  printf("max |A-B| = %g\n", md);
  double macs=(double)M*NT*4*NB*32, ba=1e9,bb=1e9;
  for(int rep=0;rep<15;rep++){double t0=now();runA(w,x,yA);double t1=now();runB(wB,x,yB);double t2=now();
    if(t1-t0<ba)ba=t1-t0; if(t2-t1<bb)bb=t2-t1;}
  float*yE=malloc(sizeof(float)*M*NT*4); runE(w,x,yE);
  double me=0; for(size_t i=0;i<(size_t)M*NT*4;i++){double d=yA[i]-yE[i]; if(d<0)d=-d; if(d>me)me=d;}
  printf("max |A-E| = %g (same lanes: 0)\n", me);
  double be=1e9;
  for(int rep=0;rep<15;rep++){double t0=now();runE(w,x,yE);double t1=now(); if(t1-t0<be)be=t1-t0;}
  printf("A phadd: %.1f GMAC/s   B interleaved: %.1f GMAC/s   E regrouped: %.1f GMAC/s (one thread, best of 15)\n",
         macs/ba/1e9, macs/bb/1e9, macs/be/1e9);
}
