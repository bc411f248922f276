"""The online-softmax update both schedules share (log2 domain: scores arrive scaled by ``sm_scale * LOG2E``)."""

import tilelang.language as T

LOG2E = 1.4426950408889634


@T.macro
def online_softmax(acc_s, acc_o, sumexp, sumexp_i, alpha, m_i, m_i_prev, HB, BI, DO, scale2):
    """The online-softmax update of one block: S [HB, BI] (scores in, P out, unnormalised), the running max m_i and
    sum, alpha = the old max's rescale, and the [HB, DO] accumulator O rescaled by it (log2 domain, ``scale2`` =
    softmax scale x log2 e)."""
    T.copy(m_i, m_i_prev)
    T.reduce_max(acc_s, m_i, dim=1, clear=False)
    for h in T.Parallel(HB):
        alpha[h] = T.exp2((m_i_prev[h] - m_i[h]) * scale2)
    for h, bi in T.Parallel(HB, BI):
        acc_s[h, bi] = T.exp2(acc_s[h, bi] * scale2 - m_i[h] * scale2)
    T.reduce_sum(acc_s, sumexp_i, dim=1)
    for h in T.Parallel(HB):
        sumexp[h] = sumexp[h] * alpha[h] + sumexp_i[h]
    for h, d in T.Parallel(HB, DO):
        acc_o[h, d] = acc_o[h, d] * alpha[h]
