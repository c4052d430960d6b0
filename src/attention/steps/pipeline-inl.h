// The attention pipeline: the named per-target steps every fused kernel is composed of
// (flash/forward.cpp, flash/backward.cpp, decode/chunk-inl.h). A kernel differs from another only in
// its loop order and in what it accumulates; each step exists once, in the file of its concern
// (listed below), all in namespace pipeline.
//
//   step                 forward (flash, decode)            backward (flash_backward)
//   load a K/V tile      read in place through row strides  the same
//   scores               S = K Qt (flash) / Qs K^T (decode)  S^T = K Qt
//   modifiers            Softcap (a whole tile), then Alibi  the same, keeping softcap's slope
//                        and ScoreMod (per line; flash)    and the score function's
//   classify a tile      ClassifyMaskTile: hidden, partial,  the same
//                        fully visible (band and rule)
//   mask                 MaskBand, MaskRuleStep, MaskTerms   the same
//                        (flash: TileLogits, a tile's band
//                        at once with MaskBandLines)
//   diagonal trim        DiagonalTrim: the lines each query  not used (no gain measured:
//                        vector of a diagonal tile needs     docs/performance-log.md)
//                        (flash's two products)
//   softmax              online: *SoftmaxUpdate*             RecomputeWeights from row stats
//   dropout              Dropout on P                        Dropout on P and on dP
//   accumulate           O += P V (GEMM, or skipping zeros   dV, dS, dK, dQ
//                        when V is not finite)
//   finish               finish_row (kernels.hpp): O / l, lse, row stats
//
// The files, one concern each (each includes what it uses; this one includes them all):
//   lines-inl.h      the vector types; where a line of scores sits (Line), a kernel's walk over
//                    queries and keys (Walk), how a tile is masked (TileMask)
//   pack-inl.h       queries in the lanes: PackTransposed, UnpackTransposed (register transposes)
//   operands-inl.h   operands read in place: EveryStepRows, PrefetchRows, RowsFinite, the strided
//                    residues' query tile (ResidueTileRows)
//   tile_mask-inl.h  ClassifyMaskTile, the band and key lengths (MaskBandLines, MaskBand), the
//                    tensor terms (MaskTerms; PrefetchTermTiles ahead of them), DiagonalTrim
//   mask_rule-inl.h  the symbolic rule along a line: MaskRuleStep, MaskWhereRuleShows
//   modifiers-inl.h  Softcap, Alibi
//   score_mod-inl.h  ScoreMod: a score function's program over a line, with its derivative
//   logits-inl.h     modifiers and mask composed in the reference's order: ScoresToLogits (a
//                    line), TileLogits (a tile of key lines)
//   softmax-inl.h    InitialMax / InitialSum (sinks), ExpSoftmax, the online updates
//                    (SoftmaxColumnsUpdate, RescaleColumns, FinishColumns; SoftmaxRowUpdate) and
//                    the backward's (RecomputeWeights, SoftmaxGradient)
//   dropout-inl.h    Dropout
// The scores' products are gemm/micro_kernel-inl.h and dot_scores-inl.h (decode's order).
//
// Scores travel in "lines" (lines-inl.h): flash's are one key over the queries in the lanes,
// decode's one query over the keys in the lanes; every step that depends on positions works from
// a line's coordinates and serves both layouts.
//
// Included by each kernel inside its Highway foreach_target pass (the -inl.h convention).

// Per-target include guard (Highway's pattern: toggles once per target).
#if defined(QKV_ATTENTION_PIPELINE_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_ATTENTION_PIPELINE_INL_H_
#undef QKV_ATTENTION_PIPELINE_INL_H_
#else
#define QKV_ATTENTION_PIPELINE_INL_H_
#endif

#include "attention/kernels.hpp"  // finish_row, accumulate_skipping_zeros: the kernels' shared scalar steps
#include "attention/steps/dropout-inl.h"
#include "attention/steps/lines-inl.h"
#include "attention/steps/logits-inl.h"
#include "attention/steps/mask_rule-inl.h"
#include "attention/steps/modifiers-inl.h"
#include "attention/steps/operands-inl.h"
#include "attention/steps/pack-inl.h"
#include "attention/steps/score_mod-inl.h"
#include "attention/steps/softmax-inl.h"
#include "attention/steps/tile_mask-inl.h"

#endif  // per-target include guard
