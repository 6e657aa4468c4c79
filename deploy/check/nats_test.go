package check

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"testing"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nkeys"
)

// secured is what a production NATS deployment has: TLS with a private CA that also verifies
// client certificates, and decentralized (JWT) authentication with one user for the replicas
// and one for setup. The replica user may not create or change streams: only the setup Job
// can, so the replicas start only when setup ran as its own user.
type secured struct {
	caPEM, clientCertPEM, clientKeyPEM []byte
	replicaCreds, setupCreds           []byte
	mod                                func(*server.Options)
}

func newSecured(t *testing.T) *secured {
	t.Helper()
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	key := func() *ecdsa.PrivateKey {
		k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		must(err)
		return k
	}
	now := time.Now()
	caKey := key()
	caTmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "deploy check CA"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	must(err)
	ca, err := x509.ParseCertificate(caDER)
	must(err)
	leaf := func(serial int64, cn string, usage x509.ExtKeyUsage, ips []net.IP) ([]byte, *ecdsa.PrivateKey) {
		k := key()
		der, err := x509.CreateCertificate(rand.Reader, &x509.Certificate{
			SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: cn},
			NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour),
			KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{usage}, IPAddresses: ips,
		}, ca, &k.PublicKey, caKey)
		must(err)
		return der, k
	}
	srvDER, srvKey := leaf(2, "127.0.0.1", x509.ExtKeyUsageServerAuth, []net.IP{net.IPv4(127, 0, 0, 1)})
	cliDER, cliKey := leaf(3, "kvmapper", x509.ExtKeyUsageClientAuth, nil)
	s := &secured{caPEM: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER}),
		clientCertPEM: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: cliDER})}
	kb, err := x509.MarshalECPrivateKey(cliKey)
	must(err)
	s.clientKeyPEM = pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kb})
	pool := x509.NewCertPool()
	pool.AddCert(ca)
	tlsCfg := &tls.Config{
		MinVersion:   tls.VersionTLS12,
		Certificates: []tls.Certificate{{Certificate: [][]byte{srvDER}, PrivateKey: srvKey}},
		ClientAuth:   tls.RequireAndVerifyClientCert,
		ClientCAs:    pool,
	}

	// An operator, its system account, and the application account with JetStream.
	okp, err := nkeys.CreateOperator()
	must(err)
	opub, _ := okp.PublicKey()
	skp, _ := nkeys.CreateAccount()
	spub, _ := skp.PublicKey()
	oc := jwt.NewOperatorClaims(opub)
	oc.SystemAccount = spub
	ojwt, err := oc.Encode(okp)
	must(err)
	operator, err := jwt.DecodeOperatorClaims(ojwt)
	must(err)
	sc := jwt.NewAccountClaims(spub)
	sc.Name = "SYS"
	sjwt, err := sc.Encode(okp)
	must(err)
	akp, _ := nkeys.CreateAccount()
	apub, _ := akp.PublicKey()
	ac := jwt.NewAccountClaims(apub)
	ac.Name = "APP"
	ac.Limits.JetStreamLimits = jwt.JetStreamLimits{MemoryStorage: -1, DiskStorage: -1, Streams: -1, Consumer: -1}
	ajwt, err := ac.Encode(okp)
	must(err)
	user := func(name string, deny ...string) []byte {
		ukp, _ := nkeys.CreateUser()
		upub, _ := ukp.PublicKey()
		uc := jwt.NewUserClaims(upub)
		uc.Name = name
		uc.Pub.Deny.Add(deny...)
		ujwt, err := uc.Encode(akp)
		must(err)
		seed, _ := ukp.Seed()
		creds, err := jwt.FormatUserConfig(ujwt, seed)
		must(err)
		return creds
	}
	s.replicaCreds = user("kvmapper", "$JS.API.STREAM.CREATE.>", "$JS.API.STREAM.UPDATE.>")
	s.setupCreds = user("kvmapper-setup")
	s.mod = func(o *server.Options) {
		o.TLS, o.TLSVerify, o.TLSConfig, o.TLSTimeout = true, true, tlsCfg, 5
		o.TrustedOperators = []*jwt.OperatorClaims{operator}
		o.SystemAccount = spub
		r := &server.MemAccResolver{}
		must(r.Store(spub, sjwt))
		must(r.Store(apub, ajwt))
		o.AccountResolver = r
	}
	return s
}
