"""Independent NumPy statements of FTPipe's formulas (spec §3-§4), float64.

Written from the spec text, loop by loop, sharing no code with jpipe.
"""

import numpy as np


def sgd_predict(theta, v, d, lrs, momentum, wd, phi=None):
  """SGD msnag/aggmsnag: the unrolled recursion of FTPipe's sgd_wd.py."""
  theta_hat = np.array(theta, np.float64)
  v_hat = np.zeros_like(theta_hat) if v is None else np.array(v, np.float64)
  for k in range(1, d + 1):
    u = wd * theta_hat
    if k == 1 and phi is not None:
      u = u + phi
    v_hat = momentum * v_hat + u
    theta_hat = theta_hat - lrs[k - 1] * v_hat
  return theta_hat


def sgd_msnag_closed_form(theta, v, d, lr, momentum):
  """FTPipe's SGD1MSNAG: theta - lr * c(d) * v, c(d) = sum_k gamma^k."""
  c = sum(momentum**k for k in range(1, d + 1))
  return np.asarray(theta, np.float64) - lr * c * np.asarray(v, np.float64)


def adam_predict(theta, m, u, t, d, lrs, b1, b2, eps, wd, phi=None):
  """Adam msnag (lambda = 0 and L2) and aggmsnag, as spec §3 writes them."""
  theta_hat = np.array(theta, np.float64)
  m = np.asarray(m, np.float64)
  u = np.asarray(u, np.float64)

  def denom(k):
    return np.sqrt(u) / np.sqrt(1 - b2 ** (t + k)) + eps

  if phi is None and wd == 0:  # closed form sum
    for k in range(1, d + 1):
      if lrs[k - 1] != 0:
        bc1 = 1 - b1 ** (t + k)
        theta_hat -= lrs[k - 1] / bc1 * b1**k * m / denom(k)
    return theta_hat
  m_hat = m.copy()
  for k in range(1, d + 1):
    eta = lrs[k - 1]
    if phi is not None and eta == 0:  # aggmsnag skips eta_k = 0
      continue
    g = wd * theta_hat
    if phi is not None and k == 1:
      g = g + phi
    m_hat = b1 * m_hat + (1 - b1) * g
    theta_hat = theta_hat - eta / (1 - b1 ** (t + k)) * m_hat / denom(k)
  return theta_hat


def adamw_predict(theta, m, u, t, d, lrs, b1, b2, eps, wd, phi=None):
  """AdamW msnag / aggmsnag: decay before each predicted update."""
  theta_hat = np.array(theta, np.float64)
  m = np.asarray(m, np.float64)
  u = np.asarray(u, np.float64)
  m_hat = m.copy()
  for k in range(1, d + 1):
    eta = lrs[k - 1]
    if eta == 0:
      continue
    denom = np.sqrt(u) / np.sqrt(1 - b2 ** (t + k)) + eps
    bc1 = 1 - b1 ** (t + k)
    theta_hat = theta_hat * (1 - eta * wd)
    if phi is None:
      theta_hat = theta_hat - eta / bc1 * b1**k * m / denom
    else:
      g = phi if k == 1 else 0.0
      m_hat = b1 * m_hat + (1 - b1) * g
      theta_hat = theta_hat - eta / bc1 * m_hat / denom
  return theta_hat


class SgdGapAware:
  """FTPipe's sgd_gap_aware + torch SGD (sgd1) with L2, one param array."""

  def __init__(self, theta, lr, momentum, wd, beta=0.999, eps=1e-8):
    self.theta = np.array(theta, np.float64)
    self.v = np.zeros_like(self.theta)
    self.a = np.zeros_like(self.theta)
    self.n = 0
    self.lr, self.momentum, self.wd = lr, momentum, wd
    self.beta, self.eps = beta, eps
    self.max_lr = lr

  def step(self, g, stale_theta):
    g = np.asarray(g, np.float64)
    before = self.v if self.momentum != 0 else g
    self.a = self.beta * self.a + (1 - self.beta) * before**2
    self.n += 1
    c = self.max_lr * (np.sqrt(self.a / (1 - self.beta**self.n)) + self.eps)
    p = 1 + np.abs(stale_theta - self.theta) / c
    g = g / p + self.wd * self.theta * (1 - p) / p
    # torch SGD: d_p = g + wd * theta; buf = momentum * buf + d_p.
    d_p = g + self.wd * self.theta
    self.v = self.momentum * self.v + d_p
    self.theta = self.theta - self.lr * self.v
    return self.theta


class AdamGapAware:
  """FTPipe's adam(w)_gap_aware + adam(w)_record, one param array."""

  def __init__(
    self, theta, lr, b1, b2, eps, wd, decoupled, beta=None, ga_eps=1e-8
  ):
    self.theta = np.array(theta, np.float64)
    self.m = np.zeros_like(self.theta)
    self.u = np.zeros_like(self.theta)
    self.s = np.zeros_like(self.theta)
    self.t = 0
    self.lr, self.b1, self.b2, self.eps = lr, b1, b2, eps
    self.wd, self.decoupled = wd, decoupled
    self.beta = b2 if beta is None else beta
    self.ga_eps = ga_eps

  def step(self, g, stale_theta):
    g = np.asarray(g, np.float64)
    c = np.sqrt(self.s) + self.ga_eps
    p = 1 + np.abs(stale_theta - self.theta) / c
    g = g / p
    if self.decoupled:
      self.theta = self.theta * (1 - self.wd * self.lr * (1 - p) / p)
    else:
      g = g + self.wd * self.theta * (1 - p) / p
      g = g + self.wd * self.theta  # torch Adam's L2
    self.t += 1
    if self.decoupled:
      self.theta = self.theta * (1 - self.lr * self.wd)  # torch AdamW
    self.m = self.b1 * self.m + (1 - self.b1) * g
    self.u = self.b2 * self.u + (1 - self.b2) * g**2
    alpha = self.lr / (1 - self.b1**self.t)
    denom = np.sqrt(self.u) / np.sqrt(1 - self.b2**self.t) + self.eps
    step = alpha * self.m / denom
    self.theta = self.theta - step
    self.s = self.beta * self.s + (1 - self.beta) * step**2
    return self.theta


def nadamw_steps(theta, grads, lr, b1, b2, eps, wd, psi):
  """PyTorch's NAdam (decoupled weight decay), as its documentation's
  pseudocode writes it, over the given gradients: the params after each."""
  theta = np.array(theta, np.float64)
  m = np.zeros_like(theta)
  v = np.zeros_like(theta)
  mu_product = 1.0
  out = []
  for t, g in enumerate(grads, start=1):
    g = np.asarray(g, np.float64)
    theta = theta - lr * wd * theta
    mu_t = b1 * (1 - 0.5 * 0.96 ** (t * psi))
    mu_next = b1 * (1 - 0.5 * 0.96 ** ((t + 1) * psi))
    mu_product *= mu_t
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    m_hat = mu_next * m / (1 - mu_product * mu_next) + (1 - mu_t) * g / (
      1 - mu_product
    )
    v_hat = v / (1 - b2**t)
    theta = theta - lr * m_hat / (np.sqrt(v_hat) + eps)
    out.append(theta.copy())
  return out


def pipemare_lr(base_lr, delay, step, anneal_steps):
  """PipeMare T1 as AsyncPP's adjust_learning_rate writes it (step from 0)."""
  if delay <= 1:
    return base_lr
  return base_lr / delay ** (1 - min((1 + step) / anneal_steps, 1))
