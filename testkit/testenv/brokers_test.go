package testenv

import "testing"

func TestServersAnswer(t *testing.T) {
	AMQP(t)
	NATSURL(t)
	if err := MariaDB(t).Ping(); err != nil {
		t.Fatal(err)
	}
	if got := Redact("amqp://guest:s3cret@host:5672/"); got != "amqp://guest:xxxxx@host:5672/" {
		t.Fatalf("Redact: %s", got)
	}
}
