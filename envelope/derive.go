package envelope

import "github.com/google/uuid"

// DeriveID returns the meta.id for a message produced while handling the
// message whose meta.id is parentID: a name-based UUID (version 5, SHA-1) of
// name in the namespace of parentID. The same parent and name always give the
// same id, so a retry of the parent re-emits the same ids and downstream
// consumers skip the copies; distinct names (or sequence numbers) give
// distinct ids.
//
// The derivation, for other SDKs to match: the namespace is parentID parsed
// as a UUID; a parentID that is not a UUID is first turned into one as the
// version 5 UUID of "urn:babel:meta-id:" + parentID in the URL namespace.
func DeriveID(parentID, name string) string {
	ns, err := uuid.Parse(parentID)
	if err != nil {
		ns = uuid.NewSHA1(uuid.NameSpaceURL, []byte("urn:babel:meta-id:"+parentID))
	}
	return uuid.NewSHA1(ns, []byte(name)).String()
}

// NewChild builds an envelope produced while handling parent: its meta.id is
// DeriveID(parent.Meta.ID, name) and its trace_id is the parent's, so the
// causal chain and the identity both survive a retry of the parent. name
// tells the children of one parent apart ("invoice", "email", or a sequence
// number such as "line-3"). Options apply after those two.
func NewChild(parent Envelope, name, urn string, data any, opts ...Option) (Envelope, error) {
	base := []Option{WithID(DeriveID(parent.Meta.ID, name)), WithTraceID(parent.TraceID)}
	return New(urn, data, append(base, opts...)...)
}
