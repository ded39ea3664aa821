"""Where the Mosaic GPU forward's bf16 error comes from: a float64 emulation of its rounding points.

    python tools/mosaic_rounding_budget.py

DeltaNet, K = V = 64, β in [0, 2], an initial state, T = 1024: the chunked forward of
pallas_kernels/mosaic_gpu/forward.py in float64, rounding to bf16 only where the kernel does
(T0 and Ag, the state S read by the products, W = V − K S, R, the decayed Q Kᵀ tile P), one
point at a time and all together, against the float64 token recurrence (rewy-math §8 ratios).
"""
import numpy as np, jax.numpy as jnp
def bf(x): return np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)).astype(np.float64)
rng = np.random.default_rng(3); T=1024; K=V=64; C=64
nrm=lambda x: x/np.linalg.norm(x,axis=-1,keepdims=True)
q=bf(nrm(rng.standard_normal((T,K)))); k=bf(nrm(rng.standard_normal((T,K)))); v=bf(rng.standard_normal((T,V)))
beta=rng.uniform(0,2,T); h0=rng.standard_normal((K,V))*0.5; scale=K**-0.5
def ref():
    S=h0.copy(); o=np.zeros((T,V))
    for t in range(T):
        S=S+np.outer(k[t], beta[t]*(v[t]-k[t]@S)); o[t]=scale*q[t]@S
    return o,S
def chunked(rT0, rS, rW, rR, rP):
    S=h0.copy(); o=np.zeros((T,V))
    for n in range(T//C):
        sl=slice(n*C,(n+1)*C); Q,Kc,Vc,b=q[sl],k[sl],v[sl],beta[sl]
        L=np.eye(C)+np.tril(b[:,None]*(Kc@Kc.T),-1); T0=np.linalg.inv(L)
        if rT0: T0=bf(T0)
        Ag=T0*b[None,:]
        if rT0: Ag=bf(Ag)
        Sl=bf(S) if rS else S
        W=Vc-Kc@Sl
        if rW: W=bf(W)
        R=Ag@W
        Rr=bf(R) if rR else R
        P=np.tril(Q@Kc.T)
        if rP: P=bf(P)
        o[sl]=scale*(Q@Sl+P@Rr)
        S=S+Kc.T@Rr
    return o,S
ro,rs=ref()
rat=lambda a,b: np.sqrt(np.mean((a-b)**2))/np.sqrt(np.mean(b**2))
for name,flags in [("all",(1,1,1,1,1)),("none",(0,0,0,0,0)),("T0 only",(1,0,0,0,0)),("S only",(0,1,0,0,0)),("W only",(0,0,1,0,0)),("R only",(0,0,0,1,0)),("P only",(0,0,0,0,1)),("all but S",(1,0,1,1,1)),("all but T0",(0,1,1,1,1))]:
    o,s=chunked(*flags); print(f"{name:12s} o {rat(o,ro):.2e} final {rat(s,rs):.2e}")
