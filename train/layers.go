package train

import "github.com/twell-ai/twell/cpu"

// Each layer's forward and backward sit side by side. Backward functions add
// into the gradients of parameters (dW += ...) and set the input gradient.

// rmsNormForward sets y = x / rms(x) * w row by row and stores 1/rms per row.
func rmsNormForward[T Float](y, inv, x, w []T, rows, h int, eps float64) {
	for r := 0; r < rows; r++ {
		xr := x[r*h : (r+1)*h]
		var ss T
		for _, v := range xr {
			ss += v * v
		}
		iv := 1 / sqrt(ss/T(h)+T(eps))
		inv[r] = iv
		yr := y[r*h : (r+1)*h]
		for i, v := range xr {
			yr[i] = v * iv * w[i]
		}
	}
}

// rmsNormBackward sets dx and adds to dw, given dy.
func rmsNormBackward[T Float](dx, dw, dy, x, w, inv []T, rows, h int) {
	for r := 0; r < rows; r++ {
		xr, dyr, dxr := x[r*h:(r+1)*h], dy[r*h:(r+1)*h], dx[r*h:(r+1)*h]
		iv := inv[r]
		var dot T
		for i, v := range xr {
			dot += dyr[i] * w[i] * v
			dw[i] += dyr[i] * v * iv
		}
		c := dot * iv * iv * iv / T(h)
		for i, v := range xr {
			dxr[i] = dyr[i]*w[i]*iv - v*c
		}
	}
}

// linearForward sets y (m x out) = x (m x in) W^T, W being out x in.
func linearForward[T Float](y, x, w []T, m, in, out int, pk *cpu.Packer) {
	mmNT(y, x, w, m, out, in, pk)
}

// linearBackward sets dx = dy W (when dx is not nil) and adds dy^T x to dw.
func linearBackward[T Float](dx, dw, dy, x, w []T, m, in, out int, pk *cpu.Packer) {
	if dx != nil {
		mmNN(dx, dy, w, m, in, out, pk)
	}
	mmTNAcc(dw, dy, x, out, in, m, pk)
}

// applyRopeAll rotates every query and key head by the angles of
// model.RoPEAngles (sign -1: the inverse rotation, which is the backward).
// Token t of the flattened batch sits at position t % seq.
func applyRopeAll[T Float](q, k []T, cos, sin []float64, m, seq, nq, nkv, hd int, sign T) {
	half := hd / 2
	cpu.ParallelFor(m, func(t int) {
		pos := t % seq
		cs, sn := cos[pos*half:(pos+1)*half], sin[pos*half:(pos+1)*half]
		for hh := 0; hh < nq; hh++ {
			ropeRotate(q[t*nq*hd+hh*hd:t*nq*hd+(hh+1)*hd], cs, sn, sign)
		}
		for hh := 0; hh < nkv; hh++ {
			ropeRotate(k[t*nkv*hd+hh*hd:t*nkv*hd+(hh+1)*hd], cs, sn, sign)
		}
	})
}

// ropeRotate rotates one head vector by the angles (cos, sin) in Hugging
// Face's rotate_half convention; sign -1 applies the inverse rotation, which
// is the backward of the forward rotation.
func ropeRotate[T Float](v []T, cos, sin []float64, sign T) {
	half := len(v) / 2
	for i := 0; i < half; i++ {
		c, s := T(cos[i]), sign*T(sin[i])
		a, b := v[i], v[i+half]
		v[i] = a*c - b*s
		v[i+half] = b*c + a*s
	}
}

// attnShape describes causal multi-head attention with grouped KV heads over
// a batch of sequences of equal length T.
type attnShape struct {
	batch, seq, heads, kvHeads, headDim int
}

// forGroups calls f for each sequence b and KV head kh, in parallel, with
// the query heads h0..h0+group-1 that read kh. Calls write disjoint rows
// of q, k, v and their gradients, so they need no locks.
func forGroups(s attnShape, f func(b, kh, h0 int)) {
	group := s.heads / s.kvHeads
	cpu.ParallelFor(s.batch*s.kvHeads, func(i int) {
		b, kh := i/s.kvHeads, i%s.kvHeads
		f(b, kh, kh*group)
	})
}

// headOf returns head h (hd values) of row r of x, whose rows hold heads
// heads.
func headOf[T any](x []T, r, heads, h, hd int) []T {
	w := heads * hd
	return x[r*w+h*hd : r*w+(h+1)*hd]
}

// attentionForward computes, for each sequence and head, P = softmax(Q K^T *
// scale) with a causal mask and O = P V. q is [B*T][heads*hd], k and v are
// [B*T][kvHeads*hd], o is [B*T][heads*hd], p is [B][heads][T][T].
func attentionForward[T Float](o, p, q, k, v []T, s attnShape) {
	hd, T_ := s.headDim, s.seq
	scale := 1 / sqrt(T(hd))
	ops := vectorOps[T]()
	forGroups(s, func(b, kh, h0 int) {
		for h := h0; h < h0+s.heads/s.kvHeads; h++ {
			P := p[(b*s.heads+h)*T_*T_ : (b*s.heads+h+1)*T_*T_]
			for i := 0; i < T_; i++ {
				qi := headOf(q, b*T_+i, s.heads, h, hd)
				row := P[i*T_ : (i+1)*T_]
				mx := T(-1e30)
				for j := 0; j <= i; j++ {
					row[j] = ops.dot(qi, headOf(k, b*T_+j, s.kvHeads, kh, hd)) * scale
					mx = max(mx, row[j])
				}
				var sum T
				for j := 0; j <= i; j++ {
					row[j] = exp(row[j] - mx)
					sum += row[j]
				}
				for j := 0; j <= i; j++ {
					row[j] /= sum
				}
				clear(row[i+1:])
				oi := headOf(o, b*T_+i, s.heads, h, hd)
				clear(oi)
				for j := 0; j <= i; j++ {
					ops.axpy(row[j], headOf(v, b*T_+j, s.kvHeads, kh, hd), oi)
				}
			}
		}
	})
}

// attentionBackward sets dq, dk, dv (dk and dv are accumulated over the
// query heads sharing a KV head, so they are cleared first).
func attentionBackward[T Float](dq, dk, dv, do, p, q, k, v []T, s attnShape) {
	hd, T_ := s.headDim, s.seq
	scale := 1 / sqrt(T(hd))
	ops := vectorOps[T]()
	clear(dk)
	clear(dv)
	forGroups(s, func(b, kh, h0 int) {
		dp := make([]T, T_)
		for h := h0; h < h0+s.heads/s.kvHeads; h++ {
			P := p[(b*s.heads+h)*T_*T_ : (b*s.heads+h+1)*T_*T_]
			for i := 0; i < T_; i++ {
				doi := headOf(do, b*T_+i, s.heads, h, hd)
				row := P[i*T_ : (i+1)*T_]
				// dP = dO V^T; dV += P^T dO.
				var rowDot T
				for j := 0; j <= i; j++ {
					d := ops.dot(doi, headOf(v, b*T_+j, s.kvHeads, kh, hd))
					ops.axpy(row[j], doi, headOf(dv, b*T_+j, s.kvHeads, kh, hd))
					dp[j] = d
					rowDot += d * row[j]
				}
				// dS = P * (dP - sum(dP * P)); dQ = dS K scale; dK += dS^T Q scale.
				qi := headOf(q, b*T_+i, s.heads, h, hd)
				dqi := headOf(dq, b*T_+i, s.heads, h, hd)
				clear(dqi)
				for j := 0; j <= i; j++ {
					ds := row[j] * (dp[j] - rowDot) * scale
					if ds == 0 {
						continue
					}
					ops.axpy(ds, headOf(k, b*T_+j, s.kvHeads, kh, hd), dqi)
					ops.axpy(ds, qi, headOf(dk, b*T_+j, s.kvHeads, kh, hd))
				}
			}
		}
	})
}

// crossEntropy returns the mean negative log-likelihood of targets under
// logits (rows x vocab) and sets dlogits to its gradient. Targets < 0 are
// ignored.
func crossEntropy[T Float](dlogits, logits []T, targets []int, vocab int) float64 {
	n := countTargets(targets)
	if n == 0 {
		clear(dlogits)
		return 0
	}
	return crossEntropySum(dlogits, logits, targets, vocab, n) / float64(n)
}

// countTargets returns the number of targets >= 0.
func countTargets(targets []int) int {
	n := 0
	for _, t := range targets {
		if t >= 0 {
			n++
		}
	}
	return n
}

// crossEntropySum returns the summed negative log-likelihood of targets
// under logits (rows x vocab) and sets dlogits to the gradient of that sum
// divided by n, the number of targets of the whole batch (the rows may be a
// chunk of it). Targets < 0 are ignored. Rows run in parallel; the loss is
// summed in row order.
func crossEntropySum[T Float](dlogits, logits []T, targets []int, vocab, n int) float64 {
	rowLoss := make([]float64, len(targets))
	cpu.ParallelFor(len(targets), func(r int) {
		t := targets[r]
		row, drow := logits[r*vocab:(r+1)*vocab], dlogits[r*vocab:(r+1)*vocab]
		if t < 0 {
			clear(drow)
			return
		}
		mx := row[0]
		for _, v := range row {
			mx = max(mx, v)
		}
		var sum T
		for i, v := range row {
			e := exp(v - mx)
			drow[i] = e
			sum += e
		}
		rowLoss[r] = -float64(row[t]-mx) + logf(float64(sum))
		for i := range drow {
			drow[i] /= sum * T(n)
		}
		drow[t] -= 1 / T(n)
	})
	loss := 0.0
	for _, l := range rowLoss {
		loss += l
	}
	return loss
}
